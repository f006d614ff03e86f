"""Real processes on loopback: `kvstore directory serve` and `kvstore worker serve`."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.client import DirectoryClient
from tests.helpers import REPO, free_port, kvstore_cmd, spawn, stop, wait_http, wait_until


@dataclass
class RunningStack:
    url: str
    data_dir: Path
    directory: subprocess.Popen
    worker: subprocess.Popen

    def run_engine(self, mode: str, tmp_path: Path, prompt_seed: int = 1, timeout_s: float = 300) -> dict:
        return run_engine(self.url, mode, tmp_path, prompt_seed, timeout_s)


def run_engine(url: str, mode: str, tmp_path: Path, prompt_seed: int = 1, timeout_s: float = 300) -> dict:
    """The reference engine in its own process; returns its JSON result."""
    import json

    out = tmp_path / f"{mode}-{prompt_seed}.json"
    log = tmp_path / f"engine-{mode}-{prompt_seed}.log"
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "tests.integration.engine", mode, "--url", url,
                               "--out", str(out), "--prompt-seed", str(prompt_seed)], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return json.loads(out.read_text())


@pytest.fixture
def running_stack(tmp_path, database_url):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    directory = spawn(kvstore_cmd("directory", "serve", "--port", str(port), "--data-dir", str(tmp_path / "var"),
                                  "--database-url", database_url), tmp_path / "directory.log")
    wait_http(url + "/readyz", proc=directory)
    worker = spawn(kvstore_cmd("worker", "serve", "--directory-url", url, "--name", "worker-0",
                               "--dram-bytes", "256MiB"), tmp_path / "worker.log")
    client = DirectoryClient(url)
    wait_until(lambda: any(w.state == "active" for w in client.workers()), 60, "worker registered")
    client.close()
    yield RunningStack(url, tmp_path / "var", directory, worker)
    stop(worker)
    stop(directory)
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]
