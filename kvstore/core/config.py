"""Settings from an optional TOML file, under the flags and the environment.

Precedence, for every setting of the directory and the worker: a command-line flag, then the
environment (`KVSTORE_…` for the directory, `KVSTORE_WORKER_…` for the worker), then the file named
by `--config` or `KVSTORE_CONFIG` (its `[directory]` and `[worker]` tables), then the default.

    [directory]
    database_url = "postgresql+psycopg://kvstore@db/kvstore"
    lease_ttl_s = 60

    [worker]
    dram_bytes = "8GiB"
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from pydantic_settings import BaseSettings, InitSettingsSource

CONFIG_ENV = "KVSTORE_CONFIG"
SECRETS = ("token", "database_url", "metrics_token")  # shown redacted by `kvstore config show`


def read_table(table: str) -> dict:
    """The `[table]` of the file named by $KVSTORE_CONFIG; {} when none is named or it has no such table."""
    name = os.environ.get(CONFIG_ENV)
    if not name:
        return {}
    path = Path(name)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"directory", "worker"})
    if unknown:
        raise ValueError(f"the config file {path} has tables {unknown}; it may have [directory] and [worker]")
    section = data.get(table, {})
    if not isinstance(section, dict):
        raise ValueError(f"[{table}] in {path} must be a table")
    return section


class TomlTable(InitSettingsSource):
    """One table of the config file as a settings source (unknown keys are refused like any input)."""

    def __init__(self, settings_cls: type[BaseSettings], table: str) -> None:
        super().__init__(settings_cls, read_table(table))


def sources(settings_cls, init, env, table: str) -> tuple:
    """Flags (init), then the environment, then the file: what settings_customise_sources returns."""
    return init, env, TomlTable(settings_cls, table)


def redact_url(url: str) -> str:
    """A URL without its user and password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def redacted(name: str, value):
    """A setting as `kvstore config show` prints it: tokens hidden, database credentials cut out."""
    if not value or name not in SECRETS:
        return value
    return redact_url(str(value)) if name == "database_url" else "***"
