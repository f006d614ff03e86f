"""Every stack the tests run, built in one place.

    with directory_stack(settings) as s:     # the directory in this process, over real HTTP, with a
        ...                                  # worker's control endpoint (real page allocator, no NIXL)
    with worker_endpoint(pages) as control:  # a worker's control endpoint alone, for a stack to use
    with directory_replica(url) as (app, u): # one directory replica in this process (PostgreSQL: several)
    s = ProcessStack(tmp_path, ...)          # `kvstore directory serve` and `kvstore worker serve` as
    s.start_directory(); s.start_worker()    # real processes on loopback (integration and fault tests)
    with s3_bucket(tmp_path, monkeypatch, "b") as moto:   # a real S3 endpoint (moto) with one bucket
    c = ReplicaCluster(tmp_path, database_url, s3_url)     # three directory replicas, three workers
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstore.client import DirectoryClient
from kvstore.core import moving, specs
from kvstore.core.credentials import TokenCreate
from kvstore.core.keys import Namespace
from kvstore.core.pages import PageAllocator
from kvstore.core.tiers import MEMORY
from kvstore.directory.process.app import create_app
from kvstore.directory.process.build import build
from kvstore.directory.settings import DirectorySettings
from kvstore.worker.control import ControlServer
from tests.helpers import MotoServer, ServerThread, free_port, kvstore_cmd, spawn, stop, wait_http, wait_until
from tests.zygote import Zygote

NS = Namespace(model_id="tiny", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)
PAGE = 128

# ---- the directory in this process ---------------------------------------------------------------


@dataclass
class Stack:
    url: str
    client: DirectoryClient
    http: httpx.Client
    allocator: PageAllocator | None
    namespace_id: str
    settings: DirectorySettings
    service: object = None  # the DirectoryService behind the HTTP API (same process)
    verdicts: "Verdicts | None" = None  # what the worker endpoint says when asked to verify replicas
    app: object = None

    def token(self, *scopes: str, tenants: tuple[str, ...] = ()) -> str:
        """A new token of `scopes` (engine ones bound to `tenants`), made in the directory's process."""
        body = TokenCreate(name="+".join(scopes), scopes=list(scopes), tenants=list(tenants))
        return self.app.state.tokens.create(body).token

    def as_(self, token: str | None) -> DirectoryClient:
        """A client that calls with `token` (None: none at all)."""
        return DirectoryClient(self.url, timeout_s=60, token=token)

    def free_pages(self, worker: str = "w0") -> int:
        """Free DRAM pages as the directory accounts them; its page credit must say the same."""
        tier = next(t for t in self.client.tiers() if t.kind == "dram" and t.worker == worker)
        assert tier.credit_free_bytes == tier.capacity_bytes - tier.used_bytes, "page pool and used_bytes disagree"
        return (tier.capacity_bytes - tier.used_bytes) // PAGE

    def register_worker(self, name: str = "w0", control_url: str = "") -> specs.Registered:
        return self.client.register_worker(registration(name, control_url, self.allocator.num_pages))


DEFAULT_MARKS = {name: specs.TierSpec.model_fields[name].default for name in ("high_watermark", "low_watermark")}


def dram_tier(pages: int, **fields) -> specs.TierSpec:
    """A DRAM tier of `pages` pages of PAGE bytes, watermarks at 1.0 (nothing demoted) unless `fields` say."""
    values = dict(kind="dram", capacity_bytes=pages * PAGE, page_bytes=PAGE, base_addr=1 << 20,
                  high_watermark=1.0, low_watermark=1.0)
    return specs.TierSpec(**{**values, **fields})


def registration(name: str = "w0", control_url: str = "", pages: int = 32, **fields) -> specs.WorkerRegistration:
    """A worker's registration as the directory-only stacks send it: one DRAM tier of `pages` pages
    unless `fields` name the tiers (or pid, backends, control_secret, inventory)."""
    values = dict(name=name, agent_name=f"{name}-agent", agent_metadata=base64.b64encode(b"md").decode(),
                  control_url=control_url, pid=1, backends=["UCX"], tiers=[dram_tier(pages)])
    return specs.WorkerRegistration(**{**values, **fields})


class Verdicts:
    """The worker endpoint's answer to `POST /v1/verify` in the directory-only stacks (they hold no
    bytes): every replica intact, or every replica corrupt (the default: a reported mismatch holds)."""

    def __init__(self, intact: bool = False) -> None:
        self.intact = intact
        self.asked: list[moving.VerifyItem] = []

    def __call__(self, req: moving.VerifyRequest) -> moving.VerifyResult:
        self.asked += req.items
        return moving.VerifyResult(matches=[self.intact] * len(req.items))


def make_settings(database_url: str, **overrides) -> DirectorySettings:
    values = dict(database_url=database_url, heartbeat_timeout_s=60, reaper_interval_s=0.1, require_auth=False)
    return DirectorySettings(**{**values, **overrides})


@contextmanager
def directory_stack(settings: DirectorySettings, control: ControlServer | None = None, pages: int = 32,
                    register: bool = True) -> Iterator[Stack]:
    """The directory over HTTP in a server thread, with a DRAM-only worker endpoint of `pages` pages
    (or `control`, which the caller owns), registered as worker w0 unless `register` is False."""
    own = control is None
    if own:
        control = ControlServer({"dram": PageAllocator(num_pages=pages, page_bytes=PAGE)}, verifier=Verdicts())
        control.start()
    try:
        app = create_app(build(settings))
        admin = app.state.tokens.create(TokenCreate(name="test admin", scopes=["admin"])).token \
            if settings.require_auth else None
        with ServerThread(app) as server:
            client = DirectoryClient(server.url, timeout_s=300, token=admin)
            s = Stack(server.url, client, httpx.Client(base_url=server.url), control.allocators.get("dram"),
                      client.register_namespace(NS), settings, app.state.service, control.verifier, app)
            try:
                if register:
                    s.register_worker(control_url=control.url)
                yield s
            finally:
                client.close()
                s.http.close()
    finally:
        if own:
            control.stop()


@contextmanager
def worker_endpoint(pages: int = 32, nvme_pages: int = 0, verifier: "Verdicts | None" = None, hbm_pages: int = 0,
                    **options) -> Iterator[ControlServer]:
    """A worker's control endpoint (DRAM of `pages` pages, NVMe of `nvme_pages` and HBM of `hbm_pages` if
    any; real page allocators, no NIXL), for `directory_stack(control=...)` or to register by hand;
    stopped on exit."""
    allocators = {"dram": PageAllocator(num_pages=pages, page_bytes=PAGE)}
    for kind, n in (("nvme", nvme_pages), ("hbm", hbm_pages)):
        if n:
            allocators[kind] = PageAllocator(num_pages=n, page_bytes=PAGE)
    control = ControlServer(allocators, verifier=verifier, **options)
    control.start()
    try:
        yield control
    finally:
        control.stop()


@contextmanager
def directory_replica(database_url: str, **overrides) -> Iterator[tuple[object, str]]:
    """One directory (a replica, on PostgreSQL) in a server thread, advertising its own address:
    (the app, its URL)."""
    port = free_port()
    app = create_app(build(make_settings(database_url, advertise_url=f"http://127.0.0.1:{port}", **overrides)))
    with ServerThread(app, port=port) as server:
        yield app, server.url


@contextmanager
def s3_bucket(tmp_path: Path, monkeypatch, bucket: str) -> Iterator[MotoServer]:
    """moto's S3 endpoint on loopback with `bucket` created; the test credentials in the environment
    (workers started from here find them like any AWS credentials)."""
    for key, value in MotoServer.CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    moto = MotoServer(tmp_path / "moto.log").start()
    try:
        moto.client().create_bucket(Bucket=bucket)
        yield moto
    finally:
        moto.stop()


@contextmanager
def two_tier_stack(database_url, mover, dram_pages: int = 32, endpoint: dict | None = None, **settings):
    """The directory (`settings` over make_settings') and a worker endpoint with DRAM (`dram_pages`)
    and NVMe (64 pages) whose mover the test scripts (`endpoint`: its other options); yields (stack,
    the endpoint)."""
    with worker_endpoint(dram_pages, nvme_pages=64, mover=mover, **(endpoint or {})) as control:
        with directory_stack(make_settings(database_url, **settings), control, register=False) as s:
            s.client.register_worker(registration("w0", control.url, backends=["UCX", "POSIX"], tiers=[
                dram_tier(dram_pages), specs.TierSpec(kind="nvme", capacity_bytes=64 * PAGE, page_bytes=PAGE)]))
            yield s, control


# ---- real processes ------------------------------------------------------------------------------


@dataclass
class ProcessStack:
    """A directory and one worker as processes; `ttl_s` shortens leases, reservations and heartbeats
    (the fault tests), `directory_args` and `worker_args` add to their command lines. Each start
    logs to its own file: directory.log, then directory-2.log, ... (worker.log likewise)."""
    tmp: Path
    database_url: str | None = None
    ttl_s: float | None = None
    worker_name: str = "w0"
    worker_memory: list[str] = field(default_factory=lambda: ["--dram-bytes", "64MiB", "--page-bytes", "16KiB"])
    worker_args: list[str] = field(default_factory=list)
    directory_args: list[str] = field(default_factory=list)
    worker_start_s: float = 60.0  # how long a worker may take to register
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    directory: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    runs: int = 0  # worker starts
    directory_runs: int = 0

    def __enter__(self) -> "ProcessStack":
        """Started: the directory, then its worker (under epoch 1); closed on exit."""
        try:
            self.start_directory()
            assert self.start_worker() == 1
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def log(self, kind: str, run: int) -> Path:
        return self.tmp / (f"{kind}.log" if run == 1 else f"{kind}-{run}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.tmp / "var"

    @property
    def client(self) -> DirectoryClient:
        return DirectoryClient(self.url)

    def start_directory(self) -> None:
        args = ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        env = dict(self.env)
        if self.database_url:
            args += ["--database-url", self.database_url]
        if self.ttl_s is not None:
            args += ["--lease-ttl", str(self.ttl_s), "--heartbeat-timeout", str(self.ttl_s)]
            env = {"KVSTORE_RESERVATION_TTL_S": str(self.ttl_s), **env}
        self.directory_runs += 1
        self.directory = spawn(kvstore_cmd("directory", "serve", "--insecure-no-auth", *args, *self.directory_args),
                               self.log("directory", self.directory_runs), env=env)
        wait_http(self.url + "/readyz?workers=0", proc=self.directory)

    def start_worker(self) -> int:
        """Start the worker and wait until it is active under a new epoch and has granted the directory
        the pages of its memory tiers (its registration answers once they are, but the worker shows
        as active before: a save in between finds no room); returns the epoch."""
        self.runs += 1
        before = {w.name: w.epoch for w in self.client.workers()}.get(self.worker_name, 0)
        self.worker = spawn(kvstore_cmd("worker", "serve", "--directory-url", self.url, "--name", self.worker_name,
                                        *self.worker_memory, *self.worker_args), self.log("worker", self.runs),
                             env=self.env)
        def active() -> bool:
            if self.worker.poll() is not None:  # it will not register: say why now, not at the timeout
                raise RuntimeError(f"the worker exited with {self.worker.returncode}: "
                                   + self.log("worker", self.runs).read_text()[-2000:])
            if not any(w.name == self.worker_name and w.state == "active" and w.epoch > before
                       for w in self.client.workers()):
                return False
            return all(t.credit_free_bytes for t in self.client.tiers()
                       if t.worker == self.worker_name and t.kind in MEMORY and t.capacity_bytes)
        wait_until(active, self.worker_start_s, "worker active under a new epoch, its pages granted")
        return self.client.worker(self.worker_name).epoch

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def kill_all(self) -> None:
        """SIGKILL the worker and the directory (a host lost), if running."""
        for proc in (self.worker, self.directory):
            if proc is not None and proc.poll() is None:
                self.kill(proc)

    def run_engine(self, mode: str, tmp_path: Path, prompt_seed: int = 1, timeout_s: float = 300) -> dict:
        return run_engine(self.url, mode, tmp_path, prompt_seed, timeout_s)

    def engine(self, mode: str, *args: str, seed: int = 1, wait: bool = True):
        """The fault engine in its own process; waits for it and returns its JSON result unless
        `wait` is False (then returns the process)."""
        markers = self.tmp / f"markers-{mode}-{seed}"
        markers.mkdir(exist_ok=True)
        out = self.tmp / f"{mode}-{seed}.json"
        proc = engines().spawn("tests.fault.engine", [mode, "--url", self.url, "--out", str(out), "--markers",
                                                      str(markers), "--prompt-seed", str(seed), *args],
                               self.tmp / f"engine-{mode}-{seed}.log")
        if not wait:
            proc.markers = markers
            return proc
        assert proc.wait(timeout=300) == 0, (self.tmp / f"engine-{mode}-{seed}.log").read_text()[-3000:]
        return json.loads(out.read_text())

    def result(self, mode: str, seed: int = 1) -> dict:
        return json.loads((self.tmp / f"{mode}-{seed}.json").read_text())

    def settled(self, within_s: float | None = None) -> None:
        """Pins, leases, reservations and moves in flight all back to zero within `within_s` (by
        default the TTL and 7 s of margin)."""
        within_s = within_s if within_s is not None else (self.ttl_s or 3.0) + 7.0
        client = self.client

        def zero() -> bool:
            s = client.stats()
            return (s.pins, s.leases_active, s.reservations, s.inflight_moves) == (0, 0, 0, 0)
        wait_until(zero, within_s, f"no pins, leases, reservations or moves (last: {client.stats()})")

    def close(self) -> None:
        for proc in (self.worker, self.directory):
            if proc is not None:
                stop(proc)


def run_engine(url: str, mode: str, tmp_path: Path, prompt_seed: int = 1, timeout_s: float = 300) -> dict:
    """The reference engine (tests/integration/engine.py) in its own process; returns its JSON result."""
    out = tmp_path / f"{mode}-{prompt_seed}.json"
    log = tmp_path / f"engine-{mode}-{prompt_seed}.log"
    proc = engines().spawn("tests.integration.engine", [mode, "--url", url, "--out", str(out), "--prompt-seed",
                                                        str(prompt_seed)], log)
    assert proc.wait(timeout=timeout_s) == 0, log.read_text()[-3000:]
    return json.loads(out.read_text())


_ENGINES: list[Zygote] = []
ENGINE_MODULES = ["tests.integration.engine", "tests.fault.engine", "tests.fault.loop_engine"]


def engines() -> Zygote:
    """Engine processes are forked from one that imported torch and transformers once
    (tests/zygote.py); it starts at the first engine run and stops with the session."""
    if not _ENGINES:
        _ENGINES.append(Zygote(ENGINE_MODULES))
    return _ENGINES[0]


def stop_engines() -> None:
    if _ENGINES:
        _ENGINES.pop().close()


# ---- several directory replicas, as processes ---------------------------------------------------------


class ReplicaCluster:
    """Three directory replicas on one PostgreSQL database and three workers on distinct loopback
    addresses (standing for hosts), each with DRAM, NVMe and an S3 prefix of its own in `bucket`, as
    processes. Engines spawned for it are killed by `close`."""

    def __init__(self, tmp: Path, database_url: str, s3_url: str, bucket: str, ttl_s: float,
                 move_timeout_s: float) -> None:
        self.tmp, self.database_url, self.s3_url, self.bucket = tmp, database_url, s3_url, bucket
        self.ttl_s, self.move_timeout_s = ttl_s, move_timeout_s
        self.ports = [free_port() for _ in range(3)]
        self.replicas: list[subprocess.Popen | None] = [None] * 3
        self.workers: dict[str, subprocess.Popen] = {}
        self.engines: list[subprocess.Popen] = []  # killed at the end, whatever happened
        self.env = {"KVSTORE_RESERVATION_TTL_S": str(ttl_s), **MotoServer.CREDENTIALS}

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    @property
    def urls(self) -> str:
        return ",".join(self.url(i) for i in range(3))

    def start_replica(self, i: int, wait: bool = True) -> None:
        self.replicas[i] = spawn(kvstore_cmd(
            "directory", "serve", "--insecure-no-auth", "--port", str(self.ports[i]), "--database-url",
            self.database_url, "--lease-ttl", str(self.ttl_s), "--heartbeat-timeout", str(self.ttl_s),
            "--move-timeout", str(self.move_timeout_s)),
            self.tmp / f"directory-{i}.log", env=self.env)
        if wait:
            wait_http(self.url(i) + "/readyz?workers=0", proc=self.replicas[i])

    def start_worker(self, i: int) -> None:
        name = f"w{i}"
        self.workers[name] = spawn(kvstore_cmd(
            "worker", "serve", "--directory-url", self.urls, "--name", name, "--host", f"127.0.0.{2 + i}",
            "--dram-bytes", "2MiB", "--page-bytes", "16KiB", "--nvme-bytes", "8MiB",
            "--nvme-dir", str(self.tmp / f"nvme-{i}"), "--s3-bucket", self.bucket, "--s3-endpoint", self.s3_url,
            "--s3-prefix", name, "--bounce-bytes", "1MiB", "--open-metrics"), self.tmp / f"worker-{i}.log",
            env=self.env)

    def start(self) -> None:
        """The three replicas (the first leads), then the three workers, until all are active."""
        for i in range(3):
            self.start_replica(i)
        for i in range(3):
            self.start_worker(i)
        wait_until(lambda: sorted(w.name for w in self.client(1).workers() if w.state == "active")
                   == ["w0", "w1", "w2"], 60, "three active workers")

    def engine(self, urls: str, seed: int, run: str = "", *args: str) -> tuple[subprocess.Popen, Path]:
        """A loop engine (tests/fault/loop_engine.py) on `urls`; (its process, its markers folder)."""
        markers = self.tmp / f"markers-{seed}{run}"
        markers.mkdir()
        proc = engines().spawn("tests.fault.loop_engine", ["--url", urls, "--seed", str(seed), "--out",
                                                           str(self.tmp / f"engine-{seed}{run}.json"), "--markers",
                                                           str(markers), *args], self.tmp / f"engine-{seed}{run}.log")
        self.engines.append(proc)
        return proc, markers

    def live(self) -> list[int]:
        return [i for i, p in enumerate(self.replicas) if p is not None and p.poll() is None]

    def client(self, i: int) -> DirectoryClient:
        return DirectoryClient(self.url(i))

    def leader(self) -> int | None:
        for i in self.live():
            try:
                if self.client(i).stats().leader:
                    return i
            except Exception:  # noqa: BLE001 (a replica that does not answer leads nothing)
                pass
        return None

    def log_tail(self, i: int | None, lines: int = 40) -> str:
        """The last warnings and errors a replica logged."""
        if i is None:
            return "(no leader)"
        text = (self.tmp / f"directory-{i}.log").read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if " WARNING " in line or " ERROR " in line][-lines:])

    def holdings(self) -> str:
        """Replicas by worker, tier and state (and how many are moves' destinations), from SQL."""
        import sqlalchemy as sa

        engine = sa.create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(
                    "SELECT w.name, w.state, t.kind, r.state, count(*), "
                    "sum(CASE WHEN r.token LIKE 'move-%' THEN 1 ELSE 0 END), min(r.expires_at) "
                    "FROM replicas r JOIN tiers t ON r.tier_id = t.id JOIN workers w ON t.worker_id = w.id "
                    "GROUP BY 1, 2, 3, 4 ORDER BY 1, 3, 4")).fetchall()
                leases = conn.execute(sa.text("SELECT count(*) FROM leases")).scalar()
        finally:
            engine.dispose()
        return "\n".join(f"{r[0]} ({r[1]}) {r[2]} {r[3]}: {r[4]} ({r[5]} moves, expiring {r[6]})" for r in rows) + \
            f"\nleases: {leases}, now {time.time():.1f}"

    def wait(self, predicate, timeout_s: float, what: str) -> None:
        """wait_until, with what the database holds and the leader's warnings when it times out."""
        try:
            wait_until(predicate, timeout_s, what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.holdings()}\nleader's log:\n{self.log_tail(self.leader())}") from None

    def kill_replica(self, i: int) -> float:
        self.replicas[i].send_signal(signal.SIGKILL)
        self.replicas[i].wait()
        return time.time()

    def close(self) -> None:
        for proc in self.engines:
            proc.kill()
            proc.wait()
        for proc in [*self.workers.values(), *self.replicas]:
            if proc is not None:
                stop(proc)
