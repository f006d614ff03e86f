"""The operator CLI against a running `kvstore up`: tiers, workers, evict (with a dry run), errors."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import torch

from kvstore.connector import KVStoreClient, Namespace
from tests.helpers import free_port, kvstore_cmd, spawn, wait_http, wait_until

NS = Namespace(model_id="cli-test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=16)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(kvstore_cmd(*args), capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_tiers_workers_and_evict_from_the_command_line(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = spawn(kvstore_cmd("up", "--port", str(port), "--data-dir", str(tmp_path / "var"), "--dram-bytes", "8MiB",
                           "--nvme-bytes", "8MiB", "--page-bytes", "16KiB"), tmp_path / "up.log")
    try:
        wait_http(url + "/readyz", proc=up)
        wait_until(lambda: json.loads(cli("workers", "--url", url, "--output", "json").stdout or "[]"), 60, "worker")
        kv = [(torch.randn(2, 160, 16), torch.randn(2, 160, 16)) for _ in range(2)]
        with KVStoreClient(url, NS, staging_bytes=1 << 20) as client:
            assert client.save(list(range(160)), kv) == 160  # 10 blocks of 16 KiB

        tiers = {t["kind"]: t for t in json.loads(cli("tiers", "--url", url, "--output", "json").stdout)}
        assert tiers["dram"]["num_blocks"] == 10 and tiers["nvme"]["num_blocks"] == 0
        listed = json.loads(cli("namespaces", "--url", url, "--output", "json").stdout)
        assert [(n["namespace_id"], n["model_id"], n["blocks"]) for n in listed] == [
            (NS.namespace_id, "cli-test", {"dram": 10})]
        assert NS.namespace_id in cli("namespaces", "--url", url).stdout
        assert tiers["dram"]["capacity_bytes"] == 8 << 20 and tiers["dram"]["used_bytes"] == 10 * 16384
        table = cli("tiers", "--url", url).stdout
        assert "dram" in table and "8.0 MiB" in table
        prompt = ",".join(map(str, range(170)))  # 10 full blocks and 10 tokens
        assert cli("lookup", NS.namespace_id, prompt, "--url", url).stdout.split() [:6] == [
            "160", "of", "170", "tokens", "stored:", "10"]
        inspected = json.loads(cli("inspect", NS.namespace_id, prompt, "--url", url, "--output", "json").stdout)
        assert [b["stored"] for b in inspected["blocks"]] == [True] * 10
        assert {(r["worker"], r["tier"], r["state"], r["pins"]) for b in inspected["blocks"] for r in b["replicas"]} \
            == {("worker-0", "dram", "ready", 0)}
        other = cli("inspect", NS.namespace_id, "9,8,7,6,5,4,3,2,1,0,1,2,3,4,5,6", "--url", url)
        assert "not stored" in other.stdout and other.returncode == 0

        dry = cli("evict", "--tier", "dram", "--bytes", "40KiB", "--dry-run", "--url", url)
        assert dry.returncode == 0 and "would move 3 blocks" in dry.stdout
        moved = cli("evict", "--tier", "dram", "--all", "--url", url)
        assert moved.returncode == 0, moved.stderr
        assert "10 blocks moved one tier down, 0 dropped" in moved.stdout
        tiers = {t["kind"]: t for t in json.loads(cli("tiers", "--url", url, "--output", "json").stdout)}
        assert (tiers["dram"]["num_blocks"], tiers["nvme"]["num_blocks"]) == (0, 10)
        refused = cli("evict", "--tier", "nvme", "--namespace", NS.namespace_id, "--url", url)
        assert refused.returncode != 0 and "delete 10 blocks" in refused.stderr and "--yes" in refused.stderr
        dry = cli("evict", "--tier", "nvme", "--namespace", NS.namespace_id, "--dry-run", "--url", url)
        assert "would move 10 blocks" in dry.stdout and "deleting 10" in dry.stdout
        dropped = cli("evict", "--tier", "nvme", "--namespace", NS.namespace_id, "--yes", "--url", url)
        assert "0 blocks moved one tier down, 10 dropped" in dropped.stdout
        with KVStoreClient(url, NS, staging_bytes=1 << 20) as client:
            assert client.lookup(list(range(160))) == 0

        workers = json.loads(cli("workers", "--url", url, "--output", "json").stdout)
        assert [(w["name"], w["state"], w["epoch"]) for w in workers] == [("worker-0", "active", 1)]
        # the worker counted its moves: 10 blocks dram -> nvme, then 10 dropped at the bottom (no move)
        scraped = httpx.get(workers[0]["control_url"] + "/metrics").text
        assert 'kvstore_worker_moves_total{result="ok",route="dram_nvme"} 10.0' in scraped
        assert f'kvstore_worker_moved_bytes_total{{route="dram_nvme"}} {10.0 * NS.block_nbytes}' in scraped
        assert 'kvstore_worker_tier_capacity_bytes{tier="nvme"}' in scraped

        failover = f"http://127.0.0.1:{free_port()},{url}"  # a directory that is gone, then the live one
        with KVStoreClient(failover, NS, staging_bytes=1 << 20) as client:
            assert client.save(list(range(160)), kv) == 160
        assert json.loads(cli("stats", "--url", failover, "--output", "json").stdout)["blocks"] == 10
        refused = cli("flush", "--namespace", NS.namespace_id, "--url", url)
        assert refused.returncode == 1 and "--yes" in refused.stderr
        planned = json.loads(cli("flush", "--namespace", NS.namespace_id, "--dry-run", "--output", "json", "--url",
                                 url).stdout)
        assert (planned["dry_run"], planned["replicas"], planned["bytes"]) == (True, 10, 10 * 16384)
        flushed = cli("flush", "--namespace", NS.namespace_id, "--yes", "--url", url)
        assert f"namespace {NS.namespace_id}: 10 replicas (160.0 KiB) deleted" in flushed.stdout, flushed.stderr
        with KVStoreClient(url, NS, staging_bytes=1 << 20) as client:
            assert client.lookup(list(range(160))) == 0
        unknown = cli("flush", "--namespace", "0" * 16, "--yes", "--url", url)
        assert unknown.returncode == 1 and "no namespace" in unknown.stderr

        info = json.loads(cli("info", "--url", url, "--output", "json").stdout)
        assert info["directory"]["status"] == "ready" and info["packages"]["nixl-cu12"]
        assert {"UCX", "POSIX"} <= set(info["nixl"]["plugins"]) and info["nixl"]["loads"]["UCX"] is True
        stats = json.loads(cli("stats", "--url", url, "--output", "json").stdout)
        assert (stats["blocks"], stats["pins"], stats["leases_active"]) == (0, 0, 0)

        view = cli("status", "--url", url)  # the cluster at a glance
        assert view.returncode == 0 and "leader" in view.stdout and "worker-0" in view.stdout, view.stderr
        gone = f"http://127.0.0.1:{free_port()}"
        partial = cli("status", "--url", f"{url},{gone}", "-o", "json", "--timeout", "2")
        assert partial.returncode == 3, partial.stderr  # one replica could not be reached
        seen = json.loads(partial.stdout)
        assert [(r["url"], r["role"], r["ready"]) for r in seen["replicas"]] == [(url, "leader", True),
                                                                                (gone, None, False)]
        assert seen["replicas"][0]["term"] == 0 and "cannot reach" in seen["replicas"][1]["detail"]  # SQLite: no election
        [worker] = seen["workers"]
        assert (worker["name"], worker["state"]) == ("worker-0", "active") and worker["heartbeat_age_s"] < 10
        assert worker["tiers"]["dram"]["capacity_bytes"] == 8 << 20
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0


def test_cli_errors_are_one_line_and_an_exit_code_that_says_whose():
    for args, message, code in (
            (("evict", "--tier", "dram", "--url", "http://127.0.0.1:9"), "exactly one of", 1),
            (("evict", "--tier", "tape", "--all"), "--tier must be", 1),
            (("tiers", "--url", "http://127.0.0.1:9"), "cannot reach", 3),  # a connection failure
            (("status", "--url", "http://127.0.0.1:9", "-o", "json"), "cannot reach", 3),
            (("evict", "--tier", "dram", "--bytes", "lots", "--url", "http://127.0.0.1:9"), "cannot read 'lots'", 1),
            (("inspect", "0" * 16, "1,2", "--hashes", "ab"), "not both", 1),
            (("lookup", "0" * 16, "1,two"), "comma-separated integers", 1),
            (("inspect", "0" * 16, "--hashes", "zz[red]"), "hashes.0: String should match pattern", 1)):
        result = cli(*args)
        if args[0] == "status":  # status reports each replica in its output, not as an error line
            assert result.returncode == code and message in result.stdout, result
            continue
        assert result.returncode == code, args
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_an_unknown_output_format_is_refused_before_anything_runs():
    for command in (("tiers",), ("workers",), ("tokens", "list"), ("namespaces",), ("stats",), ("info",), ("status",),
                    ("lookup", "x", "1"), ("inspect", "x", "1"), ("flush", "--namespace", "x"), ("tokens", "revoke", "x"),
                    ("evict", "--tier", "dram", "--all"), ("write-through", "x"), ("replicas", "x", "2"),
                    ("workers", "drain", "w"),
                    ("db", "upgrade"), ("config", "show")):
        remote = command[0] not in ("db", "config")  # those two call no directory
        result = cli(*command, "--output", "yaml", *(("--url", "http://127.0.0.1:9") if remote else ()))
        assert result.returncode == 2 and "'yaml' is not one of" in result.stderr, (command, result.stderr)
    too_many = cli("replicas", "x", "4", "--url", "http://127.0.0.1:9")
    assert too_many.returncode == 2 and "less than or equal to 3" in too_many.stderr, too_many.stderr
    assert cli("--version").stdout.startswith("kvstore ")
