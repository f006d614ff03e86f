"""Commands that run services: `up`, `directory serve`, `worker serve`."""

from __future__ import annotations

import ipaddress
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

from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import parse_size
from kvstore.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION, make_admission, make_eviction

log = logging.getLogger("kvstore")
directory_app = typer.Typer(help="The directory service.", no_args_is_help=True)
worker_app = typer.Typer(help="A storage worker.", no_args_is_help=True)

Host = Annotated[str, typer.Option(help="address to bind")]
Size = Annotated[str, typer.Option(help="bytes, e.g. 512MiB")]
Eviction = Annotated[str, typer.Option(envvar="KVSTORE_EVICTION", help="eviction policy of every tier: "
                                       "lru, arc, s3fifo, prefix-lru")]
TlsCert = Annotated[Path | None, typer.Option(help="certificate (PEM) to serve HTTPS; needs --tls-key")]
TlsKey = Annotated[Path | None, typer.Option(help="private key (PEM) of --tls-cert")]
CaFile = Annotated[str | None, typer.Option(envvar="KVSTORE_CA_FILE", help="CA bundle that peers' HTTPS "
                                            "certificates are checked against")]
Admission = Annotated[str, typer.Option(envvar="KVSTORE_ADMISSION", help="admission of every tier: adaptive, "
                                        "always, doorkeeper, tinylfu, backpressure, size:MIN-MAX; chain with commas")]


def _tls_pair(cert: Path | None, key: Path | None) -> None:
    if bool(cert) != bool(key):
        raise typer.BadParameter("give both --tls-cert and --tls-key, or neither")
    for path, flag in ((cert, "--tls-cert"), (key, "--tls-key")):
        if path is not None and not path.is_file():
            raise typer.BadParameter(f"no such file: {path}", param_hint=flag)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _size(text: str, flag: str) -> int:
    try:
        return parse_size(text)
    except KVStoreError as exc:
        raise typer.BadParameter(exc.message, param_hint=flag) from None


@directory_app.command("serve")
def directory_serve(host: Host = "127.0.0.1", port: int = 8700,
                    data_dir: Annotated[Path, typer.Option(help="SQLite file lives here")] = Path("var"),
                    database_url: Annotated[str | None, typer.Option(envvar="KVSTORE_DATABASE_URL",
                                                                     help="SQLAlchemy URL")] = None,
                    lease_ttl: float = 30.0,
                    heartbeat_timeout: Annotated[float, typer.Option(help="seconds of silence before a worker "
                                                                     "is dead")] = 10.0,
                    eviction: Eviction = DEFAULT_EVICTION, admission: Admission = DEFAULT_ADMISSION,
                    insecure_no_auth: Annotated[bool, typer.Option(help="serve every route without credentials "
                                                                   "(anyone who can connect is admin)")] = False,
                    admin_token_file: Annotated[Path | None, typer.Option(help="write a new admin token here "
                                                                          "unless it holds a valid one")] = None,
                    worker_token_file: Annotated[Path | None, typer.Option(help="the same, for a worker "
                                                                           "token")] = None,
                    open_metrics: Annotated[bool, typer.Option(help="/metrics without a token")] = False,
                    engine_rate: Annotated[float, typer.Option(help="requests/s per engine token; 0 = no "
                                                               "limit")] = 10_000.0,
                    verify_writes: Annotated[bool, typer.Option(help="a worker checksums every block before "
                                                                "it is committed")] = False,
                    tls_cert: TlsCert = None, tls_key: TlsKey = None, ca_file: CaFile = None) -> None:
    """Run the directory (FastAPI) on HOST:PORT. Every route but /healthz and /readyz needs a token
    unless --insecure-no-auth; bootstrap the first admin token with --admin-token-file."""
    import uvicorn
    from pydantic import ValidationError

    from kvstore.directory.app import create_app
    from kvstore.directory.settings import DirectorySettings

    _logging()
    _tls_pair(tls_cert, tls_key)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the database holds the workers' secrets
    url = database_url or f"sqlite:///{(data_dir / 'directory.db').resolve()}"
    try:
        settings = DirectorySettings(database_url=url, lease_ttl_s=lease_ttl, heartbeat_timeout_s=heartbeat_timeout,
                                     eviction=eviction, admission=admission, require_auth=not insecure_no_auth,
                                     open_metrics=open_metrics, engine_rate=engine_rate, verify_writes=verify_writes,
                                     ca_file=ca_file)
    except ValidationError as exc:
        raise typer.BadParameter(_problems(exc)) from None
    app = create_app(settings)
    if database_url is None:
        os.chmod(data_dir / "directory.db", 0o600)
    for path, scope in ((admin_token_file, "admin"), (worker_token_file, "worker")):
        if path is not None and bootstrap_token(app.state.tokens, path, scope):
            log.info("wrote a new %s token to %s", scope, path)
    scheme = "https" if tls_cert else "http"
    log.info("directory on %s://%s:%d, database %s, eviction %s, admission %s, credentials %s%s", scheme, host,
             port, _redact(url), eviction, admission, "OFF" if insecure_no_auth else "required",
             ", writes verified" if verify_writes else "")
    if insecure_no_auth and not is_loopback(host):
        log.warning("credentials are off and %s is not a loopback address: anyone who can reach it can evict, "
                    "drain and read every namespace", host)
    # no access log and no proxy-header rewriting: each costs the hot calls more than a lookup does
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, proxy_headers=False,
                ssl_certfile=str(tls_cert) if tls_cert else None, ssl_keyfile=str(tls_key) if tls_key else None)


def bootstrap_token(tokens, path: Path, scope: str) -> bool:
    """Keep the token in `path` if the directory knows it; else create one of `scope` and write it
    there, readable by its owner only. True if a token was written."""
    from kvstore.core.credentials import TokenCreate

    if path.exists():
        held = tokens.authenticate(path.read_text().strip())
        if held is not None and scope in held.scopes:
            return False
    created = tokens.create(TokenCreate(name=f"bootstrap {scope}", scopes=[scope]))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # private from its first byte
    with os.fdopen(fd, "w") as f:
        f.write(created.token + "\n")
    os.replace(fresh, path)  # a link at `path` is replaced, never followed
    return True


@worker_app.command("serve")
def worker_serve(directory_url: Annotated[str, typer.Option(help="directory URL")] = "http://127.0.0.1:8700",
                 name: Annotated[str, typer.Option(help="worker name")] = "worker-0",
                 host: Host = "127.0.0.1", port: Annotated[int, typer.Option(help="control port; 0 = any")] = 0,
                 dram_bytes: Size = "512MiB", page_bytes: Size = "64KiB",
                 hbm_bytes: Annotated[str, typer.Option(help="HBM tier size (needs CUDA); 0 = none")] = "0",
                 hbm_device: Annotated[int, typer.Option(help="CUDA device of the HBM tier")] = 0,
                 nvme_bytes: Annotated[str, typer.Option(help="NVMe tier size; 0 = none")] = "0",
                 nvme_dir: Annotated[Path, typer.Option(help="slab files and manifest")] = Path("var/nvme"),
                 posix_queue: Annotated[str, typer.Option(help="aio or uring")] = "aio",
                 gds: Annotated[str, typer.Option(help="HBM <-> NVMe via GDS_MT: auto, on or off")] = "auto",
                 s3_bucket: Annotated[str | None, typer.Option(help="S3 tier bucket; none = no S3 tier")] = None,
                 s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL; none = AWS")] = None,
                 s3_prefix: Annotated[str, typer.Option(help="object key prefix")] = "kvstore",
                 s3_region: Annotated[str, typer.Option(help="S3 region")] = "us-east-1",
                 bounce_bytes: Annotated[str, typer.Option(help="DRAM buffer for copies to S3")] = "64MiB",
                 token: Annotated[str | None, typer.Option(envvar="KVSTORE_TOKEN", help="worker token for the "
                                                           "directory")] = None,
                 ca_file: CaFile = None, tls_cert: TlsCert = None, tls_key: TlsKey = None) -> None:
    """Run a storage worker: allocate and register its tiers once, then serve."""
    from pydantic import ValidationError

    from kvstore.worker.server import StorageWorker
    from kvstore.worker.settings import WorkerSettings

    _logging()
    _tls_pair(tls_cert, tls_key)
    try:
        settings = WorkerSettings(directory_url=directory_url, name=name, host=host, port=port,
                                  dram_bytes=_size(dram_bytes, "--dram-bytes"),
                                  page_bytes=_size(page_bytes, "--page-bytes"),
                                  hbm_bytes=_size(hbm_bytes, "--hbm-bytes"), hbm_device=hbm_device,
                                  nvme_bytes=_size(nvme_bytes, "--nvme-bytes"), nvme_dir=nvme_dir,
                                  posix_queue=posix_queue, gds=gds, s3_bucket=s3_bucket, s3_endpoint=s3_endpoint,
                                  s3_prefix=s3_prefix, s3_region=s3_region,
                                  bounce_bytes=_size(bounce_bytes, "--bounce-bytes"), token=token, ca_file=ca_file,
                                  tls_cert=tls_cert, tls_key=tls_key)
    except ValidationError as exc:
        raise typer.BadParameter(_problems(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        worker = StorageWorker(settings)
        worker.start()
    except KVStoreError as exc:
        log.error("worker cannot start: %s", exc)
        raise typer.Exit(1) from None
    worker.run(stop)
    worker.close()
    log.info("worker %s stopped", name)
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


def up(host: Host = "127.0.0.1", port: Annotated[int, typer.Option(help="directory port")] = 8700,
       data_dir: Annotated[Path, typer.Option(help="state lives here")] = Path("var"),
       dram_bytes: Size = "512MiB", page_bytes: Size = "64KiB",
       nvme_bytes: Annotated[str, typer.Option(help="NVMe tier size; 0 disables")] = "1GiB",
       nvme_dir: Annotated[Path | None, typer.Option(help="default: DATA_DIR/nvme")] = None,
       s3_bucket: Annotated[str | None, typer.Option(help="S3 tier bucket; none = no S3 tier")] = None,
       s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL; none = AWS")] = None,
       s3_prefix: Annotated[str, typer.Option(help="object key prefix")] = "kvstore",
       s3_region: Annotated[str, typer.Option(help="S3 region")] = "us-east-1",
       lease_ttl: Annotated[float, typer.Option(help="seconds before an unreleased pin expires")] = 30.0,
       heartbeat_timeout: Annotated[float, typer.Option(help="seconds of silence before a worker is dead")] = 10.0,
       eviction: Eviction = DEFAULT_EVICTION, admission: Admission = DEFAULT_ADMISSION,
       require_auth: Annotated[bool, typer.Option(help="credentials even on loopback; the admin token is "
                                                  "written to DATA_DIR/admin.token")] = False) -> None:
    """Run the embedded stack: the directory on SQLite and one storage worker (restarted if it dies).
    Bound to a loopback address it runs without credentials unless --require-auth; bound to any
    other address it always requires them."""
    _logging()
    _size(dram_bytes, "--dram-bytes"), _size(page_bytes, "--page-bytes"), _size(nvme_bytes, "--nvme-bytes")
    _policies(eviction, admission)
    nvme_dir = nvme_dir or data_dir / "nvme"
    url = f"http://{host}:{port}"
    exe = [sys.executable, "-m", "kvstore.cli.main"]
    auth = require_auth or not is_loopback(host)
    admin_file, worker_file = data_dir / "admin.token", data_dir / "worker.token"
    credentials = ["--admin-token-file", str(admin_file), "--worker-token-file", str(worker_file)] if auth \
        else ["--insecure-no-auth"]
    children = [subprocess.Popen(exe + ["directory", "serve", "--host", host, "--port", str(port),
                                        "--data-dir", str(data_dir), "--lease-ttl", str(lease_ttl),
                                        "--heartbeat-timeout", str(heartbeat_timeout),
                                        "--eviction", eviction, "--admission", admission, *credentials])]
    worker_cmd = exe + ["worker", "serve", "--directory-url", url, "--name", "worker-0", "--host", host,
                        "--dram-bytes", dram_bytes, "--page-bytes", page_bytes, "--nvme-bytes", nvme_bytes,
                        "--nvme-dir", str(nvme_dir), "--s3-prefix", s3_prefix, "--s3-region", s3_region] \
        + (["--s3-bucket", s3_bucket] if s3_bucket else []) + (["--s3-endpoint", s3_endpoint] if s3_endpoint else [])
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


class Restarts:
    """Back-off between restarts of a crashing worker: 1 s, doubling to 30 s; reset after 60 s up."""

    def __init__(self) -> None:
        self.delay_s, self.last = 0.5, 0.0

    def next_delay(self) -> float:
        now = time.monotonic()
        self.delay_s = 1.0 if now - self.last > 60 else min(30.0, self.delay_s * 2)
        self.last = now
        return self.delay_s


def _policies(eviction: str, admission: str) -> None:
    """Refuse unknown policy names before any process starts."""
    try:
        make_eviction(eviction, 1)
    except KVStoreError as exc:
        raise typer.BadParameter(exc.message, param_hint="--eviction") from None
    try:
        make_admission(admission, 1)
    except KVStoreError as exc:
        raise typer.BadParameter(exc.message, param_hint="--admission") from None


def _problems(exc) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())


def _wait_healthy(url: str, child: subprocess.Popen, stop: threading.Event, timeout_s: float = 60) -> bool:
    from kvstore.client.http import JsonHttp

    probe = JsonHttp(url, timeout_s=1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if child.poll() is not None:
            log.error("the directory exited with code %s", child.returncode)
            return False
        try:
            probe.call_raw("GET", "/readyz")
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


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.INFO)  # main() configured WARNING for operator commands
    for noisy in ("alembic.runtime.plugins",):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
