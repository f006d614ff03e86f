"""`kvstore directory serve` and `kvstore worker serve`.

Every setting of the directory and the worker has a flag here. A flag given on the command line
wins over the environment, which wins over the config file (`--config` / KVSTORE_CONFIG), which
wins over the default (kvstore.core.config); a flag not given leaves the others to decide.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from kvstore.cli.common import Output, console, problems
from kvstore.core.config import CONFIG_ENV, redact_url
from kvstore.core.errors import KVStoreError
from kvstore.policies import ADMISSION, DEFAULT_ADMISSION, DEFAULT_EVICTION, EVICTION

log = logging.getLogger("kvstore")
EVICTION_NAMES, ADMISSION_NAMES = ", ".join(EVICTION), ", ".join(ADMISSION)  # --help lists every policy
directory_app = typer.Typer(help="The directory service.", no_args_is_help=True)
worker_app = typer.Typer(help="A storage worker.", no_args_is_help=True)

Host = Annotated[str, typer.Option(help="address to bind")]
Config = Annotated[Path | None, typer.Option(envvar=CONFIG_ENV, help="TOML file with [directory] and [worker] "
                                              "tables; flags and the environment override it")]
Seconds = Annotated[float | None, typer.Option(help="seconds")]
Size = Annotated[str | None, typer.Option(help="bytes, e.g. 512MiB")]
TlsCert = Annotated[Path | None, typer.Option(help="certificate (PEM) to serve HTTPS; needs --tls-key")]
TlsKey = Annotated[Path | None, typer.Option(help="private key (PEM) of --tls-cert")]
CaFile = Annotated[str | None, typer.Option(help="CA bundle that peers' HTTPS certificates are checked against")]

# flag (parameter name) -> setting; tests/unit/test_config.py holds them to every setting
DIRECTORY_FLAGS = {
    "database_url": "database_url", "lease_ttl": "lease_ttl_s", "reservation_ttl": "reservation_ttl_s",
    "heartbeat_interval": "heartbeat_interval_s", "heartbeat_timeout": "heartbeat_timeout_s",
    "reaper_interval": "reaper_interval_s", "move_timeout": "move_timeout_s", "migrate": "migrate_on_start",
    "eviction": "eviction", "admission": "admission", "eviction_by_tier": "eviction_by_tier",
    "admission_by_tier": "admission_by_tier", "eviction_order": "eviction_order", "require_auth": "require_auth", "open_metrics": "open_metrics",
    "engine_rate": "engine_rate", "engine_burst": "engine_burst", "verify_writes": "verify_writes",
    "relaxed_commits": "relaxed_commits", "ca_file": "ca_file", "advertise_url": "advertise_url"}
WORKER_FLAGS = {name: name for name in (
    "directory_url", "name", "host", "port", "dram_bytes", "page_bytes", "hbm_bytes", "hbm_device", "nvme_bytes",
    "nvme_dir", "nvme_direct", "posix_queue", "gds", "s3_bucket", "s3_endpoint", "s3_prefix", "s3_region",
    "s3_virtual_addressing", "bounce_bytes", "token", "ca_file", "tls_cert", "tls_key", "open_metrics",
    "metrics_token", "advertise_host", "arena_dir")}


def settings_from(cls, flags: dict, names: dict):
    """`cls` from the flags given (None: not given), then the environment, the config file, the defaults."""
    from pydantic import ValidationError

    given = {names[flag]: value for flag, value in flags.items() if flag in names and value is not None}
    try:
        return cls(**given)
    except ValidationError as exc:
        raise typer.BadParameter(problems(exc, "settings")) from None
    except ValueError as exc:  # the config file
        raise typer.BadParameter(str(exc)) from None


def use_config(path: Path | None) -> None:
    if path is not None:
        os.environ[CONFIG_ENV] = str(path)  # the settings read it; children started from here inherit it


def _json_flag(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise typer.BadParameter(f"not JSON: {text!r}", param_hint=flag) from None
    if not isinstance(value, dict):
        raise typer.BadParameter('a JSON object, e.g. {"s3": "lru"}', param_hint=flag)
    return value


@directory_app.command("serve")
def directory_serve(
        host: Host = "127.0.0.1", port: Annotated[int, typer.Option(help="port to bind")] = 8700,
        data_dir: Annotated[Path, typer.Option(help="the SQLite file lives here (unless --database-url)")]
        = Path("var"),
        config: Config = None,
        database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL; default: SQLite in DATA_DIR")] = None,
        lease_ttl: Annotated[float | None, typer.Option(help="seconds before a reader's pin expires")] = None,
        reservation_ttl: Annotated[float | None, typer.Option(help="seconds before an uncompleted save "
                                                                   "rolls back")] = None,
        heartbeat_interval: Annotated[float | None, typer.Option(help="seconds between heartbeats, told to "
                                                                      "workers")] = None,
        heartbeat_timeout: Annotated[float | None, typer.Option(help="seconds of silence before a worker is "
                                                                     "dead")] = None,
        reaper_interval: Annotated[float | None, typer.Option(help="seconds between reaper rounds")] = None,
        move_timeout: Annotated[float | None, typer.Option(help="seconds a worker may take for a batch of "
                                                                "tier moves")] = None,
        migrate: Annotated[bool | None, typer.Option("--migrate/--no-migrate", help="run the migrations at "
                                                     "start")] = None,
        eviction: Annotated[str | None, typer.Option(help=f"eviction policy of every tier: {EVICTION_NAMES} "
                                                          f"[{DEFAULT_EVICTION}]")] = None,
        admission: Annotated[str | None, typer.Option(help=f"admission of the memory tiers: {ADMISSION_NAMES}, "
                                                           "size:MIN-MAX, or a comma-separated chain "
                                                           f"[{DEFAULT_ADMISSION}]")] = None,
        eviction_by_tier: Annotated[str | None, typer.Option(help='JSON, e.g. {"s3": "lru"}')] = None,
        admission_by_tier: Annotated[str | None, typer.Option(help='JSON, e.g. {"nvme": "always"}')] = None,
        eviction_order: Annotated[str | None, typer.Option(help="where the eviction orders live: child (a "
                                                                "process of their own) or directory [child]")]
        = None,
        require_auth: Annotated[bool | None, typer.Option("--require-auth/--insecure-no-auth",
                                                          help="credentials on every route but /healthz and "
                                                               "/readyz (the default), or none at all: anyone "
                                                               "who can connect is admin")] = None,
        open_metrics: Annotated[bool | None, typer.Option("--open-metrics/--no-open-metrics",
                                                          help="/metrics without a token")] = None,
        engine_rate: Annotated[float | None, typer.Option(help="requests/s per engine token; 0 = no limit")]
        = None,
        engine_burst: Annotated[float | None, typer.Option(help="requests an engine token may send at once")]
        = None,
        verify_writes: Annotated[bool | None, typer.Option("--verify-writes/--no-verify-writes",
                                                           help="a worker checksums every block before it is "
                                                                "committed")] = None,
        relaxed_commits: Annotated[bool | None, typer.Option(
            "--relaxed-commits/--no-relaxed-commits", help="PostgreSQL: saves do not wait for the database's "
            "flush; a database crash loses its last moments of saves (misses, never wrong bytes)")] = None,
        ca_file: CaFile = None,
        advertise_url: Annotated[str | None, typer.Option(help="URL the other directory replicas on the same "
                                                               "PostgreSQL database reach this one at "
                                                               "[http(s)://HOST:PORT]")] = None,
        admin_token_file: Annotated[Path | None, typer.Option(help="write a new admin token here unless it "
                                                                   "holds a valid one")] = None,
        worker_token_file: Annotated[Path | None, typer.Option(help="the same, for a worker token")] = None,
        tls_cert: TlsCert = None, tls_key: TlsKey = None) -> None:
    """Run the directory (FastAPI) on HOST:PORT. Every route but /healthz and /readyz needs a token
    unless --insecure-no-auth; bootstrap the first admin token with --admin-token-file."""
    import uvicorn

    from kvstore.core.handoffs import MAX_WAIT_S
    from kvstore.directory.process.app import create_app
    from kvstore.directory.settings import DirectorySettings

    service_logging()
    tls_pair(tls_cert, tls_key)
    use_config(config)
    flags = {**locals(), "eviction_by_tier": _json_flag(eviction_by_tier, "--eviction-by-tier"),
             "admission_by_tier": _json_flag(admission_by_tier, "--admission-by-tier")}
    settings = settings_from(DirectorySettings, flags, DIRECTORY_FLAGS)
    if "database_url" not in settings.model_fields_set:  # nobody named one: SQLite in the data dir
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the database holds the workers' secrets
        settings = settings.model_copy(update={"database_url": f"sqlite:///{(data_dir / 'directory.db').resolve()}"})
    if settings.advertise_url is None:
        if settings.database_url.startswith("postgresql") and host in ("0.0.0.0", "::", ""):
            raise typer.BadParameter(f"{host} is every address of this host; other directory replicas need one "
                                     "they can reach: add --advertise-url", param_hint="--host")
        named = f"[{host}]" if ":" in host else host
        settings = settings.model_copy(update={"advertise_url": f"{'https' if tls_cert else 'http'}://{named}:{port}"})
    app = create_app(settings)
    sqlite_file = settings.database_url.removeprefix("sqlite:///")
    if settings.database_url.startswith("sqlite:///") and os.path.exists(sqlite_file):
        os.chmod(sqlite_file, 0o600)
    for path, scope in ((admin_token_file, "admin"), (worker_token_file, "worker")):
        if path is not None:
            try:
                done = bootstrap_token(app.state.tokens, path, scope)
            except KVStoreError as exc:
                log.error("directory cannot start: %s", exc)
                raise typer.Exit(1) from None
            if done != "kept":
                log.info("%s token %s: %s", scope, "taken from" if done == "adopted" else "written to", path)
    scheme = "https" if tls_cert else "http"
    log.info("directory on %s://%s:%d, database %s, eviction %s, admission %s, credentials %s%s", scheme, host,
             port, redact_url(settings.database_url), settings.eviction, settings.admission,
             "required" if settings.require_auth else "OFF", ", writes verified" if settings.verify_writes else "")
    if not settings.require_auth and not is_loopback(host):
        log.warning("credentials are off and %s is not a loopback address: anyone who can reach it can evict, "
                    "drain and read every namespace", host)
    # no access log and no proxy-header rewriting: each costs the hot calls more than a lookup does
    # a hand-off wait answers within MAX_WAIT_S; nothing else takes long
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, proxy_headers=False,
                timeout_graceful_shutdown=int(MAX_WAIT_S) + 5,
                ssl_certfile=str(tls_cert) if tls_cert else None, ssl_keyfile=str(tls_key) if tls_key else None)


def bootstrap_token(tokens, path: Path, scope: str) -> str:
    """Keep the token in `path` if the directory knows it ("kept"); adopt a token it has never seen
    when an operator chose it ("adopted": well formed, random-looking, in a file only its owner,
    root or this user, may change, e.g. a Kubernetes Secret, which may be read-only); else create
    one of `scope` and write it there, readable by its owner only ("written")."""
    from kvstore.core.credentials import TokenCreate

    request = TokenCreate(name=f"bootstrap {scope}", scopes=[scope])
    if path.exists():
        try:
            held = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise KVStoreError("invalid", f"cannot read the token file {path}: {exc}") from None
        known = tokens.authenticate(held)
        if known is not None and scope in known.scopes:
            return "kept"
        if known is None and adoptable(path, held) and tokens.create(request, secret=held):
            return "adopted"
    fresh = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # private from its first byte
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise KVStoreError("invalid", f"{path} holds no valid {scope} token and a new one cannot be written "
                           f"there ({exc.strerror}): put a token in it (kvs_ and 43 URL-safe base64 characters) "
                           "or make its directory writable") from None
    try:
        created = tokens.create(request)
        with os.fdopen(fd, "w") as f:
            f.write(created.token + "\n")
        os.replace(fresh, path)  # a link at `path` is replaced, never followed
    except BaseException:
        fresh.unlink(missing_ok=True)
        raise
    return "written"


def adoptable(path: Path, token: str) -> bool:
    """A token an operator put there: well formed, not a pattern a person typed (at least 16
    different characters; 43 random ones have about 30), in a file (the link's target) that no
    group or other user may change, owned by root or by this user."""
    import re

    from kvstore.core.credentials import TOKEN_PATTERN

    if not re.fullmatch(TOKEN_PATTERN, token) or len(set(token[4:])) < 16:
        return False
    info = path.resolve().stat()
    return info.st_mode & 0o022 == 0 and info.st_uid in (0, os.getuid())


@worker_app.command("serve")
def worker_serve(
        config: Config = None,
        directory_url: Annotated[str | None, typer.Option(help="directory URL [http://127.0.0.1:8700]")] = None,
        name: Annotated[str | None, typer.Option(help="worker name [worker-HOSTNAME]")] = None,
        host: Annotated[str | None, typer.Option(help="address the control endpoint binds [127.0.0.1]")] = None,
        advertise_host: Annotated[str | None, typer.Option(help="address the directory calls this worker at, "
                                                           "if not --host (needed with --host 0.0.0.0)")] = None,
        port: Annotated[int | None, typer.Option(help="control port; 0 = any [0]")] = None,
        dram_bytes: Annotated[str | None, typer.Option(help="DRAM arena [512MiB]")] = None,
        page_bytes: Annotated[str | None, typer.Option(help="page size of every tier [4KiB]")] = None,
        hbm_bytes: Annotated[str | None, typer.Option(help="HBM tier size (needs CUDA); 0 = none [0]")] = None,
        hbm_device: Annotated[int | None, typer.Option(help="CUDA device of the HBM tier [0]")] = None,
        nvme_bytes: Annotated[str | None, typer.Option(help="NVMe tier size; 0 = none [0]")] = None,
        nvme_dir: Annotated[Path | None, typer.Option(help="slab files and manifest [var/nvme]")] = None,
        nvme_direct: Annotated[str | None, typer.Option(help="NVMe slabs with O_DIRECT: auto (where the "
                                                        "filesystem takes it), on or off [auto]")] = None,
        posix_queue: Annotated[str | None, typer.Option(help="aio or uring [aio]")] = None,
        gds: Annotated[str | None, typer.Option(help="HBM <-> NVMe via GDS_MT: auto, on or off [auto]")] = None,
        s3_bucket: Annotated[str | None, typer.Option(help="S3 tier bucket; none = no S3 tier")] = None,
        s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL; none = AWS")] = None,
        s3_prefix: Annotated[str | None, typer.Option(help="object key prefix [kvstore]")] = None,
        s3_region: Annotated[str | None, typer.Option(help="S3 region [us-east-1]")] = None,
        s3_virtual_addressing: Annotated[bool | None, typer.Option(
            "--s3-virtual-addressing/--s3-path-addressing", help="bucket in the host name [path]")] = None,
        bounce_bytes: Annotated[str | None, typer.Option(help="DRAM buffer for copies to S3 [64MiB]")] = None,
        arena_dir: Annotated[str | None, typer.Option(help="folder of the socket that hands the DRAM arena to "
                                                      "engines on this host; '' = NIXL only [/tmp/kvstore]")] = None,
        token: Annotated[str | None, typer.Option(help="worker token for the directory "
                                                  "(KVSTORE_WORKER_TOKEN, else KVSTORE_TOKEN)")] = None,
        ca_file: Annotated[str | None, typer.Option(help="CA bundle the directory's certificate is checked "
                                                    "against (KVSTORE_WORKER_CA_FILE, else KVSTORE_CA_FILE)")] = None,
        tls_cert: TlsCert = None, tls_key: TlsKey = None,
        open_metrics: Annotated[bool | None, typer.Option("--open-metrics/--no-open-metrics", help="serve GET "
                                                          "/metrics without a credential [off]")] = None,
        metrics_token: Annotated[str | None, typer.Option(help="bearer token GET /metrics accepts "
                                                          "(KVSTORE_WORKER_METRICS_TOKEN)")] = None) -> None:
    """Run a storage worker: allocate and register its tiers once, then serve."""
    from kvstore.worker.server import StorageWorker
    from kvstore.worker.settings import WorkerSettings

    service_logging()
    use_config(config)
    settings = settings_from(WorkerSettings, dict(locals()), WORKER_FLAGS)
    tls_pair(settings.tls_cert, settings.tls_key)
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
    log.info("worker %s stopped", settings.name)
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


def tls_pair(cert: Path | None, key: Path | None) -> None:
    if bool(cert) != bool(key):
        raise typer.BadParameter("give both --tls-cert and --tls-key, or neither")
    for path, flag in ((cert, "--tls-cert"), (key, "--tls-key")):
        if path is not None and not Path(path).is_file():
            raise typer.BadParameter(f"no such file: {path}", param_hint=flag)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def service_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.INFO)  # main() configured WARNING for operator commands
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


config_app = typer.Typer(help="Settings in force.", no_args_is_help=True)


@config_app.command("show")
def config_show(config: Config = None, output: Output = "table") -> None:
    """Every setting of the directory and the worker as the environment and the config file make it
    (a command's flags come on top), where each value comes from, secrets redacted."""
    from rich.table import Table

    use_config(config)
    rows = settings_rows()
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    table = Table("service", "setting", "value", "from")
    for row in rows:
        table.add_row(row["service"], row["setting"], str(row["value"]), row["source"])
    console.print(table)


def settings_rows() -> list[dict]:
    """{service, setting, source (env, file or default), value (secrets redacted)} of every setting."""
    from kvstore.core.config import read_table, redacted
    from kvstore.directory.settings import DirectorySettings
    from kvstore.worker.settings import GENERIC, WorkerSettings

    rows = []
    for service, cls, prefix in (("directory", DirectorySettings, "KVSTORE_"), ("worker", WorkerSettings,
                                                                                   "KVSTORE_WORKER_")):
        settings = settings_from(cls, {}, {})
        try:
            in_file = read_table(service)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        for name in cls.model_fields:
            source = "env" if prefix + name.upper() in os.environ else "file" if name in in_file else "default"
            value = getattr(settings, name)
            if service == "worker" and source == "default" and name in GENERIC and value is not None:
                source = f"env {GENERIC[name]}"
            rows.append({"service": service, "setting": name, "source": source,
                         "value": redacted(name, str(value) if isinstance(value, Path) else value)})
    return rows
