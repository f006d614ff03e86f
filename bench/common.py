"""Benchmark plumbing: a directory + worker on loopback, medians, tables, JSON."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import free_port, kvstore_cmd, stop, wait_http, wait_until  # noqa: E402


@contextmanager
def local_stack(dram_bytes: str, page_bytes: str = "64KiB", worker_args: tuple[str, ...] = (),
                pids: dict[str, int] | None = None, directory_args: tuple[str, ...] = (),
                database_url: str | None = None, replicas: int = 1):
    """Directory (SQLite in a temp dir, or `database_url`) and one worker, as separate processes on
    loopback; yields the directory URL, or the comma-separated URLs of `replicas` directory replicas
    (PostgreSQL only; the first started leads). Process ids go into `pids` ("directory" or
    "directory-0", "directory-1", ..., and "worker") when it is given."""
    from kvstore.client import DirectoryClient

    assert replicas == 1 or database_url, "several directory replicas need a PostgreSQL database"
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        ports = [free_port() for _ in range(replicas)]
        url = ",".join(f"http://127.0.0.1:{port}" for port in ports)
        logs = open(Path(tmp) / "stack.log", "wb")
        database = ("--database-url", database_url) if database_url else ("--data-dir", tmp)
        directories, worker = [], None
        try:
            for port in ports:
                directories.append(subprocess.Popen(
                    kvstore_cmd("directory", "serve", "--insecure-no-auth", "--port", str(port), *database,
                                *directory_args), stdout=logs, stderr=subprocess.STDOUT, cwd=REPO))
                wait_http(f"http://127.0.0.1:{port}/readyz?workers=0", proc=directories[-1])
            worker = subprocess.Popen(kvstore_cmd("worker", "serve", "--directory-url", url, "--dram-bytes",
                                                  dram_bytes, "--page-bytes", page_bytes, *worker_args),
                                      stdout=logs, stderr=subprocess.STDOUT, cwd=REPO)
            if pids is not None:
                pids.update({"directory": directories[0].pid} if replicas == 1 else
                            {f"directory-{i}": d.pid for i, d in enumerate(directories)})
                pids["worker"] = worker.pid
            client = DirectoryClient(url)
            wait_until(lambda: any(w.state == "active" for w in client.workers()), 120, "worker registered")
            yield url
        finally:
            if worker is not None:
                stop(worker)
            for directory in directories:
                stop(directory)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def raw_xfer(agent, op: str, local: np.ndarray, remote: np.ndarray, peer: str,
             remote_mem: str = "DRAM") -> float:
    """Seconds for one NIXL request posted and polled directly: the baseline the store is compared to.
    `local` rows are (addr, len) in DRAM; `remote` rows are (addr, len, dev)."""
    r = agent._raw  # the bench reaches under kvstore's wrapper on purpose
    ld = r.get_xfer_descs(np.c_[local[:, :2], np.zeros(len(local), np.uint64)].astype(np.uint64), "DRAM")
    rd = r.get_xfer_descs(remote.astype(np.uint64), remote_mem)
    t0 = time.perf_counter()
    handle = r.initialize_xfer(op, ld, rd, peer)
    state = r.transfer(handle)
    while state != "DONE":
        state = r.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    r.release_xfer_handle(handle)
    return elapsed


def random_hash(chain: int, k: int = 0) -> str:
    """Block k of chain `chain` as a 128-bit hash that looks random (as real prefix hashes do) and is
    the same in every run: ascending hashes would hide what a random key costs an index."""
    return hashlib.blake2b(f"{chain}:{k}".encode(), digest_size=16).hexdigest()


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "date": time.strftime("%Y-%m-%d")}


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


