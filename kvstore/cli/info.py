"""`kvstore info`: versions, the NIXL backends this host can load, the settings in force, and
whether the directory answers."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata

from rich.table import Table

from kvstore import __version__
from kvstore.cli.common import DEFAULT_URL, CaFile, Output, Token, Url, directory, emit, one_line_errors
from kvstore.cli.serve import Config, settings_rows, use_config
from kvstore.core.errors import KVStoreError

PACKAGES = ("nixl-cu12", "torch", "fastapi", "sqlalchemy", "psycopg", "boto3", "transformers", "vllm")
# in a child process: loading NIXL's plugins must not take this one down with it
_PROBE = """
import json
from kvstore.transfer import Agent
agent = Agent("kvstore-info", backends={})
found = agent.plugins()
print(json.dumps({"plugins": found, "loads": {b: agent.add_backend(b, {}) for b in ("UCX", "POSIX", "GDS_MT")
                                              if b in found}}))
agent.close()
"""
SUMMARY = {"directory": ("database_url", "require_auth", "eviction", "admission", "lease_ttl_s", "verify_writes"),
           "worker": ("directory_url", "name", "dram_bytes", "nvme_bytes", "page_bytes", "s3_bucket")}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nixl() -> dict:
    if _version("nixl-cu12") is None:
        return {"error": "NIXL is not installed (pip install 'kvstore[worker]')"}
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {"error": "loading NIXL timed out"}
    try:
        return json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return {"error": f"loading NIXL failed: {last}"}


@one_line_errors
def info(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, config: Config = None,
         output: Output = "table") -> None:
    """Versions, the NIXL backends this host can load, the settings in force, the directory's health."""
    use_config(config)
    try:
        health = directory(url, token, ca_file, timeout_s=5).call_raw("GET", "/readyz?workers=0")["status"]
    except KVStoreError as exc:
        health = f"not ready: {exc}"
    rows = {row["service"] + "." + row["setting"]: row["value"] for row in settings_rows()
            if row["setting"] in SUMMARY[row["service"]]}
    report = {"kvstore": __version__, "python": platform.python_version(), "platform": platform.platform(),
              "packages": {p: _version(p) for p in PACKAGES}, "nixl": _nixl(), "settings": rows,
              "directory": {"url": url, "status": health}}

    def table() -> Table:
        t = Table("", "", show_header=False)
        t.add_row("kvstore", f"{__version__} (Python {report['python']}, {report['platform']})")
        for package, version in report["packages"].items():
            t.add_row(package, version or "not installed")
        nixl = report["nixl"]
        t.add_row("NIXL plugins", nixl.get("error") or ", ".join(nixl["plugins"]))
        if "loads" in nixl:
            t.add_row("NIXL loads here", ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in nixl["loads"].items()))
        for name, value in rows.items():
            t.add_row(name, str(value))
        t.add_row("directory", f"{url}: {health}")
        return t
    emit(output, report, table)

