"""A kvstore stack (directory + worker processes from this environment) for the vLLM contract
tests, and a runner for engine processes (tests_vllm/engine.py): forked from one process that
imported vLLM once (tests/zygote.py), or, for a run that needs its own environment (a hash
seed), started as a new interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.client import DirectoryClient
from tests.helpers import REPO, free_port, kvstore_cmd, spawn, stop, wait_http, wait_until
from tests.zygote import Zygote


class Stack:
    def __init__(self, tmp: Path, ttl_s: float | None = None) -> None:
        """`ttl_s`: leases, reservations and heartbeats expire after this (fault tests)."""
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.ttl = ["--lease-ttl", str(ttl_s), "--reservation-ttl", str(ttl_s), "--heartbeat-timeout",
                    str(ttl_s)] if ttl_s else []

    def start(self) -> None:
        self.procs.append(spawn(kvstore_cmd("directory", "serve", "--insecure-no-auth", "--port", str(self.port),
                                            "--data-dir", str(self.tmp / "var"), *self.ttl), self.tmp / "directory.log"))
        wait_http(self.url + "/healthz", proc=self.procs[0])
        self.procs.append(spawn(kvstore_cmd("worker", "serve", "--directory-url", self.url, "--name", "w0",
                                            "--dram-bytes", "64MiB", "--page-bytes", "4KiB"),
                                self.tmp / "worker.log"))
        client = DirectoryClient(self.url)
        wait_until(lambda: any(w.state == "active" for w in client.workers()), 120, "worker up")

    def engine(self, *args: str, env: dict | None = None) -> dict:
        """Run one engine process (tests_vllm/engine.py) to the end; its report."""
        return self.report(self.start_engine(*args, env=env))

    def start_engine(self, *args: str, env: dict | None = None):
        """An engine process, running; `report` waits for it."""
        self.engines = getattr(self, "engines", 0) + 1
        out = self.tmp / f"engine-{self.engines}.json"
        argv = ["--url", self.url, "--out", str(out), *args]
        if env is None:
            proc = zygote().spawn("tests_vllm.engine", argv, out.with_suffix(".log"))
        else:
            proc = subprocess.Popen([sys.executable, "-m", "tests_vllm.engine", *argv], cwd=REPO,
                                    stdout=open(out.with_suffix(".log"), "ab"), stderr=subprocess.STDOUT, env=env)
        proc.out = out
        return proc

    def report(self, proc: subprocess.Popen) -> dict:
        assert proc.wait(timeout=300) == 0, proc.out.with_suffix(".log").read_text()[-4000:]
        return json.loads(proc.out.read_text())

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


_ZYGOTE: list[Zygote] = []


def zygote() -> Zygote:
    """The engines' zygote (tests/zygote.py), started at the first engine run."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(["tests_vllm.engine"]))
    return _ZYGOTE[0]


def pytest_sessionfinish(session, exitstatus) -> None:
    if _ZYGOTE:
        _ZYGOTE.pop().close()


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    s.start()
    yield s
    s.stop()
