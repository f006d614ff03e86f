"""Every stack the tests run, built in one place.

    with directory_stack(settings) as s:     # the directory in this process, over real HTTP, with a
        ...                                  # worker's control endpoint (real page allocator, no NIXL)
    s = ProcessStack(tmp_path, ...)          # `kvstore directory serve` and `kvstore worker serve` as
    s.start_directory(); s.start_worker()    # real processes on loopback (integration and fault tests)
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
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
from kvstore.directory.app import create_app
from kvstore.directory.settings import DirectorySettings
from kvstore.worker.control import ControlServer
from tests.helpers import ServerThread, free_port, kvstore_cmd, spawn, stop, wait_http, wait_until
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
        return self.client.register_worker(specs.WorkerRegistration(
            name=name, agent_name=f"{name}-agent", agent_metadata=base64.b64encode(b"md").decode(),
            control_url=control_url, pid=1, backends=["UCX"],
            tiers=[specs.TierSpec(kind="dram", capacity_bytes=self.allocator.num_pages * PAGE,
                                  page_bytes=PAGE, base_addr=1 << 20, high_watermark=1.0, low_watermark=1.0)]))


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
        app = create_app(settings)
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


# ---- real processes ------------------------------------------------------------------------------


@dataclass
class ProcessStack:
    """A directory and one worker as processes; `ttl_s` shortens leases, reservations and heartbeats
    (the fault tests), `worker_args` add to the worker's command line."""
    tmp: Path
    database_url: str | None = None
    ttl_s: float | None = None
    worker_name: str = "w0"
    worker_memory: list[str] = field(default_factory=lambda: ["--dram-bytes", "64MiB", "--page-bytes", "16KiB"])
    worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    directory: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    runs: int = 0

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
        self.directory = spawn(kvstore_cmd("directory", "serve", "--insecure-no-auth", *args), self.tmp / "directory.log", env=env)
        wait_http(self.url + "/readyz?workers=0", proc=self.directory)

    def start_worker(self) -> int:
        """Start the worker and wait until it is active under a new epoch; returns the epoch."""
        self.runs += 1
        before = {w.name: w.epoch for w in self.client.workers()}.get(self.worker_name, 0)
        self.worker = spawn(kvstore_cmd("worker", "serve", "--directory-url", self.url, "--name", self.worker_name,
                                        *self.worker_memory, *self.worker_args), self.tmp / "worker.log", env=self.env)
        wait_until(lambda: any(w.name == self.worker_name and w.state == "active" and w.epoch > before
                               for w in self.client.workers()), 60, "worker active under a new epoch")
        return self.client.worker(self.worker_name).epoch

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

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
