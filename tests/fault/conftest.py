"""Real processes on loopback with short TTLs, and the means to hurt them: SIGKILL of engines,
workers and the directory, a paused or slowed engine, an S3 endpoint that goes away.

Every test ends with `stack.settled()`: within TTL + margin, no pins, leases, reservations or
moves in flight are left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstore.client import DirectoryClient
from tests.helpers import REPO, free_port, kvstore_cmd, spawn, stop, wait_http, wait_until

TTL_S = 3.0  # leases, reservations and heartbeats
SETTLE_S = TTL_S + 7.0


@dataclass
class FaultStack:
    tmp: Path
    port: int = field(default_factory=free_port)
    worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    directory: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    runs: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> DirectoryClient:
        return DirectoryClient(self.url)

    def start_directory(self) -> None:
        self.directory = spawn(kvstore_cmd("directory", "serve", "--port", str(self.port), "--data-dir",
                                           str(self.tmp / "var"), "--lease-ttl", str(TTL_S), "--heartbeat-timeout",
                                           str(TTL_S)),
                               self.tmp / "directory.log", env={"KVSTORE_RESERVATION_TTL_S": str(TTL_S), **self.env})
        wait_http(self.url + "/readyz", proc=self.directory)

    def start_worker(self) -> int:
        """Start the worker and wait until it is active; returns its epoch."""
        self.runs += 1
        self.worker = spawn(kvstore_cmd("worker", "serve", "--directory-url", self.url, "--name", "w0",
                                        "--dram-bytes", "64MiB", "--page-bytes", "16KiB", *self.worker_args),
                            self.tmp / "worker.log", env=self.env)
        before = {w.name: w.epoch for w in self.client.workers()}.get("w0", 0)
        wait_until(lambda: any(w.state == "active" and w.epoch > before for w in self.client.workers()), 60,
                   "worker active under a new epoch")
        return self.client.worker("w0").epoch

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def engine(self, mode: str, *args: str, seed: int = 1, wait: bool = True):
        """The fault engine in its own process; waits for it and returns its JSON result unless
        `wait` is False (then returns the process)."""
        markers = self.tmp / f"markers-{mode}-{seed}"
        markers.mkdir(exist_ok=True)
        out = self.tmp / f"{mode}-{seed}.json"
        cmd = [sys.executable, "-m", "tests.fault.engine", mode, "--url", self.url, "--out", str(out),
               "--markers", str(markers), "--prompt-seed", str(seed), *args]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(self.tmp / f"engine-{mode}-{seed}.log", "ab"),
                                stderr=subprocess.STDOUT)
        if not wait:
            proc.markers = markers
            return proc
        assert proc.wait(timeout=300) == 0, (self.tmp / f"engine-{mode}-{seed}.log").read_text()[-3000:]
        return json.loads(out.read_text())

    def result(self, mode: str, seed: int = 1) -> dict:
        return json.loads((self.tmp / f"{mode}-{seed}.json").read_text())

    def settled(self) -> None:
        """Pins, leases, reservations and moves in flight all back to zero within TTL + margin."""
        client = self.client

        def zero() -> bool:
            s = client.stats()
            return (s.pins, s.leases_active, s.reservations, s.inflight_moves) == (0, 0, 0, 0)
        wait_until(zero, SETTLE_S, f"no pins, leases, reservations or moves (last: {client.stats()})")

    def close(self) -> None:
        for proc in (self.worker, self.directory):
            if proc is not None:
                stop(proc)


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    wait_until(lambda: path.exists() or proc.poll() is not None, timeout_s, f"{path.name}")
    assert path.exists(), f"the engine exited ({proc.returncode}) before {path.name}"


@pytest.fixture
def stack(tmp_path):
    s = FaultStack(tmp_path)
    s.start_directory()
    s.start_worker()
    yield s
    s.close()
