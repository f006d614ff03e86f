"""Real processes on loopback: `kvstore directory serve` and `kvstore worker serve`."""

from __future__ import annotations

import pytest

from tests.stacks import ProcessStack


@pytest.fixture
def running_stack(tmp_path, database_url):
    with ProcessStack(tmp_path, database_url=database_url, worker_name="worker-0",
                      worker_memory=["--dram-bytes", "256MiB"]) as s:
        yield s
    assert s.worker.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]
