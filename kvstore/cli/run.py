"""`kvstore up`: the directory and one storage worker as child processes on one host."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from kvstore.cli.serve import ADMISSION_NAMES, EVICTION_NAMES, Config, Host, is_loopback, service_logging, settings_from, use_config
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import parse_size
from kvstore.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION, make_admission, make_eviction

log = logging.getLogger("kvstore")


def up(host: Host = "127.0.0.1", port: Annotated[int, typer.Option(help="directory port")] = 8700,
       data_dir: Annotated[Path, typer.Option(help="state lives here")] = Path("var"),
       config: Config = None,
       dram_bytes: Annotated[str | None, typer.Option(help="the worker's DRAM arena [512MiB]")] = None,
       page_bytes: Annotated[str | None, typer.Option(help="page size of every tier [4KiB]")] = None,
       nvme_bytes: Annotated[str | None, typer.Option(help="NVMe tier size; 0 disables [1GiB]")] = None,
       nvme_dir: Annotated[Path | None, typer.Option(help="[DATA_DIR/nvme]")] = None,
       s3_bucket: Annotated[str | None, typer.Option(help="S3 tier bucket; none = no S3 tier")] = None,
       s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL; none = AWS")] = None,
       s3_prefix: Annotated[str | None, typer.Option(help="object key prefix [kvstore]")] = None,
       s3_region: Annotated[str | None, typer.Option(help="S3 region [us-east-1]")] = None,
       lease_ttl: Annotated[float | None, typer.Option(help="seconds before an unreleased pin expires [30]")]
       = None,
       heartbeat_timeout: Annotated[float | None, typer.Option(help="seconds of silence before a worker is "
                                                                    "dead [10]")] = None,
       eviction: Annotated[str | None, typer.Option(help=f"eviction policy of every tier: {EVICTION_NAMES} "
                                                         f"[{DEFAULT_EVICTION}]")] = None,
       admission: Annotated[str | None, typer.Option(help=f"admission of the memory tiers: {ADMISSION_NAMES} "
                                                          f"[{DEFAULT_ADMISSION}]")] = None,
       require_auth: Annotated[bool, typer.Option(help="credentials even on loopback; the admin token is "
                                                  "written to DATA_DIR/admin.token")] = False) -> None:
    """Run the embedded stack: the directory on SQLite and one storage worker (restarted if it dies).
    Bound to a loopback address it runs without credentials unless --require-auth; bound to any
    other address it always requires them. Other flags not given are left to the environment and
    the config file, like the services' own; what ties the two together (the worker's directory
    URL, name and host) comes from up."""
    from kvstore.worker.settings import WorkerSettings

    service_logging()
    use_config(config)
    for text, flag in ((dram_bytes, "--dram-bytes"), (page_bytes, "--page-bytes"), (nvme_bytes, "--nvme-bytes")):
        _size(text, flag)
    _policies(eviction, admission)
    worker = settings_from(WorkerSettings, {}, {})  # what the environment and the file say
    if nvme_bytes is None and "nvme_bytes" not in worker.model_fields_set:
        nvme_bytes = "1GiB"  # up's own default: a small NVMe tier under the data dir
    if nvme_dir is None and "nvme_dir" not in worker.model_fields_set:
        nvme_dir = data_dir / "nvme"
    url = f"http://{host}:{port}"
    exe = [sys.executable, "-m", "kvstore.cli.main"]
    auth = require_auth or not is_loopback(host)
    admin_file, worker_file = data_dir / "admin.token", data_dir / "worker.token"
    # up decides this itself (the environment's and the file's require_auth do not apply to it)
    credentials = ["--require-auth", "--admin-token-file", str(admin_file), "--worker-token-file",
                   str(worker_file)] if auth else ["--insecure-no-auth"]
    directory_cmd = exe + ["directory", "serve", "--host", host, "--port", str(port), "--data-dir", str(data_dir),
                           *_given({"--lease-ttl": lease_ttl, "--heartbeat-timeout": heartbeat_timeout,
                                    "--eviction": eviction, "--admission": admission}), *credentials]
    worker_cmd = exe + ["worker", "serve", "--directory-url", url, "--name", "worker-0", "--host", host,
                        *_given({"--dram-bytes": dram_bytes, "--page-bytes": page_bytes, "--nvme-bytes": nvme_bytes,
                                 "--nvme-dir": nvme_dir, "--s3-bucket": s3_bucket, "--s3-endpoint": s3_endpoint,
                                 "--s3-prefix": s3_prefix, "--s3-region": s3_region}),
                        *([] if auth else ["--open-metrics"])]  # without credentials, its metrics are open too
    children = [subprocess.Popen(directory_cmd)]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker_env = None
    try:
        if not _wait_healthy(url, children[0], stop):
            raise typer.Exit(1)
        if auth:  # the directory wrote both before it began to answer
            worker_env = {**os.environ, "KVSTORE_TOKEN": worker_file.read_text().strip()}
        children.append(subprocess.Popen(worker_cmd, env=worker_env))
        log.info("kvstore up: directory %s, data dir %s; Ctrl-C stops", url, data_dir.resolve())
        if auth:
            log.info("credentials required: the admin token is in %s (export KVSTORE_TOKEN=$(cat %s)); "
                     "kvstore tokens create makes engine tokens", admin_file, admin_file)
        else:
            log.warning("credentials are off: %s is a loopback address, so only this host can connect "
                        "(--require-auth turns them on)", host)
        restarts = Restarts()
        while not stop.wait(0.5):
            if children[0].poll() is not None:
                log.error("the directory exited (code %s); stopping the stack", children[0].returncode)
                raise typer.Exit(1)
            if children[1].poll() is not None:
                delay = restarts.next_delay()
                log.error("the worker exited (code %s); restarting it in %.0fs", children[1].returncode, delay)
                if stop.wait(delay):
                    break
                children[1] = subprocess.Popen(worker_cmd, env=worker_env)
    finally:
        _stop_all(children)


def _given(flags: dict) -> list[str]:
    return [part for flag, value in flags.items() if value is not None for part in (flag, str(value))]


def _size(text: str | None, flag: str) -> None:
    if text is not None:
        try:
            parse_size(text)
        except KVStoreError as exc:
            raise typer.BadParameter(exc.message, param_hint=flag) from None


class Restarts:
    """Back-off between restarts of a crashing worker: 1 s, doubling to 30 s; reset after 60 s up."""

    def __init__(self) -> None:
        self.delay_s, self.last = 0.5, 0.0

    def next_delay(self) -> float:
        now = time.monotonic()
        self.delay_s = 1.0 if now - self.last > 60 else min(30.0, self.delay_s * 2)
        self.last = now
        return self.delay_s


def _policies(eviction: str | None, admission: str | None) -> None:
    """Refuse unknown policy names before any process starts."""
    for name, make, flag in ((eviction, make_eviction, "--eviction"), (admission, make_admission, "--admission")):
        if name is not None:
            try:
                make(name, 1)
            except KVStoreError as exc:
                raise typer.BadParameter(exc.message, param_hint=flag) from None


def _wait_healthy(url: str, child: subprocess.Popen, stop: threading.Event, timeout_s: float = 60) -> bool:
    from kvstore.client.http import JsonHttp

    probe = JsonHttp(url, timeout_s=1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if child.poll() is not None:
            log.error("the directory exited with code %s", child.returncode)
            return False
        try:
            probe.call_raw("GET", "/readyz?workers=0")  # the worker starts after this
            return True
        except KVStoreError:
            pass
        time.sleep(0.2)
    return False


def _stop_all(children: list[subprocess.Popen]) -> None:
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in reversed(children):
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
    log.info("kvstore stopped")
