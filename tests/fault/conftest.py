"""Real processes on loopback with short TTLs, and the means to hurt them: SIGKILL of engines,
workers and the directory, a paused or slowed engine, an S3 endpoint that goes away.

Every test ends with `stack.settled()`: within TTL + margin, no pins, leases, reservations or
moves in flight are left."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.stacks import ProcessStack

TTL_S = 3.0  # leases, reservations and heartbeats
SETTLE_S = TTL_S + 7.0


def fault_stack(tmp_path: Path, worker_args: list[str] = ()) -> ProcessStack:
    """Real processes with short TTLs; `worker_args` add to the worker's command line."""
    return ProcessStack(tmp_path, ttl_s=TTL_S, worker_args=list(worker_args))


def wait_for(path: Path, proc, timeout_s: float = 120) -> None:
    wait_until(lambda: path.exists() or proc.poll() is not None, timeout_s, f"{path.name}")
    assert path.exists(), f"the engine exited ({proc.returncode}) before {path.name}"


@pytest.fixture
def stack(tmp_path):
    s = fault_stack(tmp_path)
    s.start_directory()
    s.start_worker()
    yield s
    s.close()
