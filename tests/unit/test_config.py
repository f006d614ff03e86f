"""Every setting of the directory and the worker has a flag, and takes its value from the flag, then
the environment, then the config file, then its default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from kvstore.cli.serve import DIRECTORY_FLAGS, WORKER_FLAGS, directory_app, settings_from, worker_app
from kvstore.directory.settings import DirectorySettings
from kvstore.worker.settings import WorkerSettings

# per setting: the file's value, the environment's, the flag's (each differs from the one before it,
# and the file's from the default)
SAMPLES = {
    DirectorySettings: {
        "database_url": ("sqlite:///a.db", "sqlite:///b.db", "sqlite:///c.db"),
        "lease_ttl_s": (11.0, 12.0, 13.0), "reservation_ttl_s": (21.0, 22.0, 23.0),
        "heartbeat_interval_s": (2.0, 3.0, 4.0), "heartbeat_timeout_s": (20.0, 30.0, 40.0),
        "reaper_interval_s": (0.2, 0.3, 0.4), "move_timeout_s": (100.0, 200.0, 250.0),
        "migrate_on_start": (False, True, False), "eviction": ("arc", "s3fifo", "prefix-lru"),
        "admission": ("always", "doorkeeper", "tinylfu"),
        # per-tier maps merge key by key across sources; the same key shows which source wins
        "eviction_by_tier": ({"s3": "lru"}, {"s3": "arc"}, {"s3": "s3fifo"}),
        "admission_by_tier": ({"s3": "tinylfu"}, {"s3": "doorkeeper"}, {"s3": "always"}),
        "eviction_order": ("directory", "child", "directory"),
        "require_auth": (False, True, False), "open_metrics": (True, False, True),
        "engine_rate": (100.0, 200.0, 300.0), "engine_burst": (10.0, 20.0, 30.0),
        "verify_writes": (True, False, True), "relaxed_commits": (True, False, True),
        "ca_file": ("/a.pem", "/b.pem", "/c.pem"),
        "advertise_url": ("http://d1:8700", "http://d2:8700", "https://d3:8700")},
    WorkerSettings: {
        "directory_url": ("http://h1:1", "http://h2:2", "http://h3:3"), "name": ("w-a", "w-b", "w-c"),
        "host": ("127.0.0.2", "127.0.0.3", "127.0.0.4"), "port": (9001, 9002, 9003),
        "dram_bytes": (2 << 20, 3 << 20, 4 << 20), "page_bytes": (8192, 16384, 32768),
        "hbm_bytes": (1 << 20, 2 << 20, 3 << 20), "hbm_device": (1, 2, 3),
        "nvme_bytes": (1 << 20, 2 << 20, 3 << 20), "nvme_dir": (Path("/n1"), Path("/n2"), Path("/n3")),
        "nvme_direct": ("on", "off", "on"), "posix_queue": ("uring", "aio", "uring"), "gds": ("on", "off", "on"),
        "s3_bucket": ("bucket-a", "bucket-b", "bucket-c"), "s3_endpoint": ("http://s1", "http://s2", "http://s3"),
        "s3_prefix": ("p1", "p2", "p3"), "s3_region": ("eu-west-1", "eu-west-2", "eu-west-3"),
        "s3_virtual_addressing": (True, False, True), "bounce_bytes": (2 << 20, 3 << 20, 4 << 20),
        "token": ("t1", "t2", "t3"), "ca_file": ("/a.pem", "/b.pem", "/c.pem"),
        "tls_cert": (Path("/c1"), Path("/c2"), Path("/c3")), "tls_key": (Path("/k1"), Path("/k2"), Path("/k3")),
        "open_metrics": (True, False, True), "metrics_token": ("m" * 16, "n" * 16, "o" * 16),
        "advertise_host": ("w1.example", "w2.example", "w3.example"),
        "arena_dir": (Path("/a1"), Path("/a2"), Path("/a3"))},
}
CASES = [(DirectorySettings, "directory", "KVSTORE_", DIRECTORY_FLAGS, directory_app),
         (WorkerSettings, "worker", "KVSTORE_WORKER_", WORKER_FLAGS, worker_app)]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f'{k} = "{v}"' for k, v in value.items()) + "}"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _env(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, dict) else str(value)


@pytest.mark.parametrize("cls, table, prefix, flags, command", CASES, ids=["directory", "worker"])
def test_every_setting_has_a_flag(cls, table, prefix, flags, command):
    serve = typer.main.get_command(command)  # a Typer of one command is that command
    params = {p.name for p in getattr(serve, "commands", {}).get("serve", serve).params}
    assert set(flags) <= params, sorted(set(flags) - params)
    assert sorted(flags.values()) == sorted(cls.model_fields) == sorted(SAMPLES[cls])


@pytest.mark.parametrize("cls, table, prefix, flags, command", CASES, ids=["directory", "worker"])
def test_flag_then_environment_then_file_then_default(cls, table, prefix, flags, command, tmp_path, monkeypatch):
    for name in cls.model_fields:
        monkeypatch.delenv(prefix + name.upper(), raising=False)
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    defaults = cls()
    flag_of = {field: flag for flag, field in flags.items()}
    for name in cls.model_fields:
        from_file, from_env, from_flag = SAMPLES[cls][name]
        assert from_file != getattr(defaults, name), name
        config = tmp_path / f"{name}.toml"
        config.write_text(f"[{table}]\n{name} = {_toml(from_file)}\n")
        monkeypatch.setenv("KVSTORE_CONFIG", str(config))
        assert getattr(settings_from(cls, {}, flags), name) == from_file, (name, "file")
        monkeypatch.setenv(prefix + name.upper(), _env(from_env))
        assert getattr(settings_from(cls, {}, flags), name) == from_env, (name, "environment over file")
        assert getattr(settings_from(cls, {flag_of[name]: from_flag}, flags), name) == from_flag, (name, "flag")
        monkeypatch.delenv(prefix + name.upper())
        monkeypatch.delenv("KVSTORE_CONFIG")
        assert getattr(settings_from(cls, {}, flags), name) == getattr(defaults, name), (name, "default")


def test_a_bad_config_file_is_one_clear_error(tmp_path, monkeypatch):
    for text, message in (("[directory\n", "not valid TOML"), ("[database]\nx = 1\n", "may have [directory]"),
                          ("[directory]\nlease_tll_s = 3\n", "lease_tll_s"),
                          ("[worker]\ndram_bytes = \"lots\"\n", "lots")):
        config = tmp_path / "kvstore.toml"
        config.write_text(text)
        monkeypatch.setenv("KVSTORE_CONFIG", str(config))
        with pytest.raises(typer.BadParameter) as refused:
            settings_from(DirectorySettings if "worker" not in text else WorkerSettings, {}, {})
        assert message in str(refused.value), (text, str(refused.value))
    monkeypatch.setenv("KVSTORE_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(typer.BadParameter, match="cannot read the config file"):
        settings_from(WorkerSettings, {}, {})


def test_help_names_every_policy_and_the_defaults_the_settings_use():
    from kvstore.cli.main import app

    root = typer.main.get_command(app)
    commands = [root.commands["up"], root.commands["directory"].commands["serve"]]
    defaults = DirectorySettings()
    for command in commands:
        options = {p.name: p.help for p in command.params}
        assert options["eviction"].endswith(f"[{defaults.eviction}]"), command.name
        assert options["admission"].endswith(f"[{defaults.admission}]"), command.name
        assert all(name in options["eviction"] for name in ("lru", "arc", "s3fifo", "prefix-lru", "session"))
        assert all(name in options["admission"] for name in ("adaptive", "always", "tinylfu", "session"))


@pytest.mark.parametrize("name, generic", [("token", "KVSTORE_TOKEN"), ("ca_file", "KVSTORE_CA_FILE")])
def test_the_worker_takes_the_generic_variable_only_when_its_own_setting_is_given_nowhere(tmp_path, monkeypatch,
                                                                                           name, generic):
    """Flag, KVSTORE_WORKER_..., config file, then KVSTORE_TOKEN / KVSTORE_CA_FILE (what every command reads)."""
    from kvstore.cli.main import app
    from kvstore.cli.serve import settings_rows

    def setting(flags=None):
        return getattr(settings_from(WorkerSettings, flags or {}, WORKER_FLAGS), name)
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    monkeypatch.delenv(f"KVSTORE_WORKER_{name.upper()}", raising=False)
    monkeypatch.setenv(generic, "kvs_generic")
    assert setting() == "kvs_generic"
    row = next(r for r in settings_rows() if (r["service"], r["setting"]) == ("worker", name))
    assert row["source"] == f"env {generic}"
    assert (row["value"] != "kvs_generic") is (name == "token")  # a token is shown redacted
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[worker]\n{name} = "kvs_file"\n')
    monkeypatch.setenv("KVSTORE_CONFIG", str(config))
    assert setting() == "kvs_file"
    monkeypatch.setenv(f"KVSTORE_WORKER_{name.upper()}", "kvs_worker")
    assert setting() == "kvs_worker"
    flag = next(f for f, field in WORKER_FLAGS.items() if field == name)
    assert setting({flag: "kvs_flag"}) == "kvs_flag"
    # no setting's option of `worker serve` reads a variable itself: it would stand for the flag, beating the rest
    serve = typer.main.get_command(app).commands["worker"].commands["serve"]
    assert [p.name for p in serve.params if p.envvar and WORKER_FLAGS.get(p.name) in WorkerSettings.model_fields] == []
