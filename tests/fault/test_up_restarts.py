"""`kvstore up` restarts a worker process that died; the new one joins under a new epoch and the
stack serves again without an operator."""

from __future__ import annotations

import os
import signal

from kvstore.client import DirectoryClient
from tests.fault.conftest import TTL_S
from tests.helpers import free_port, kvstore_cmd, spawn, wait_http, wait_until
from tests.helpers import interrupt


def test_up_restarts_a_killed_worker_under_a_new_epoch(tmp_path):
    port = free_port()
    proc = spawn(kvstore_cmd("up", "--port", str(port), "--data-dir", str(tmp_path / "var"), "--dram-bytes", "16MiB",
                             "--nvme-bytes", "0", "--heartbeat-timeout", str(TTL_S)), tmp_path / "up.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", proc=proc)
        client = DirectoryClient(url)
        wait_until(lambda: [(w.state, w.epoch) for w in client.workers()] == [("active", 1)], 60, "worker up")
        first = client.workers()[0].pid
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: [(w.state, w.epoch) for w in client.workers()] == [("active", 2)], 60,
                   "worker restarted by kvstore up")
        assert client.workers()[0].pid != first
        assert "the worker exited" in (tmp_path / "up.log").read_text()
    finally:
        assert interrupt(proc) == 0
