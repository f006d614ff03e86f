"""`kvstore up`: one command runs directory + worker; Ctrl-C stops both; state survives a restart."""

from __future__ import annotations


import torch

from kvstore.client import DirectoryClient
from kvstore.connector import KVStoreClient, Namespace
from tests.helpers import free_port, interrupt, kvstore_cmd, spawn, wait_http, wait_until

NS = Namespace(model_id="up-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


def start_up(port: int, data_dir, log, epoch: int = 1):
    proc = spawn(kvstore_cmd("up", "--port", str(port), "--data-dir", str(data_dir), "--dram-bytes", "16MiB"), log)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", proc=proc)
    client = DirectoryClient(url)
    wait_until(lambda: [(w.state, w.epoch) for w in client.workers()] == [("active", epoch)], 60,
               "worker registered")
    return proc, client


def test_up_serves_stops_cleanly_and_keeps_state_across_restarts(tmp_path):
    port, data_dir = free_port(), tmp_path / "var"
    proc, directory = start_up(port, data_dir, tmp_path / "up1.log")
    tokens = list(range(12))
    kv = [(torch.randn(2, 12, 8), torch.randn(2, 12, 8)) for _ in range(2)]
    with KVStoreClient(directory.base_url, NS, staging_bytes=1 << 20) as client:
        assert client.save(tokens, kv) == 12
        assert client.lookup(tokens) == 12
    assert interrupt(proc) == 0
    log = (tmp_path / "up1.log").read_text()
    for expected in ("directory on http://127.0.0.1", "NIXL agent worker-0-", "backends UCX",
                     "DRAM arena 16.0 MiB registered", "kvstore stopped"):
        assert expected in log, expected
    assert (data_dir / "directory.db").exists()

    proc, directory = start_up(port, data_dir, tmp_path / "up2.log", epoch=2)  # remembered, new epoch
    try:
        # the namespace is still known; the DRAM copies died with the old worker process
        assert directory.lookup_tokens(NS.namespace_id, tokens).hit_tokens == 0
    finally:
        assert interrupt(proc) == 0


def test_up_refuses_a_bad_size_with_one_line(tmp_path):
    import subprocess

    result = subprocess.run(kvstore_cmd("up", "--dram-bytes", "lots"), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "cannot read 'lots' as a size" in result.stderr
    assert "Traceback" not in result.stderr
