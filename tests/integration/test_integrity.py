"""What a loader gets when stored bytes go bad: the longest verified prefix, never wrong KV."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.connector import KVStoreClient, Namespace
from kvstore.core import specs
from kvstore.core.keys import block_hashes

NS = Namespace(model_id="integrity", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=8)


def test_a_corrupted_block_shortens_the_load_to_the_verified_prefix(running_stack):
    tokens = list(range(40))  # 5 blocks
    kv = [(torch.randn(2, 40, 16), torch.randn(2, 40, 16)) for _ in range(2)]
    with KVStoreClient(running_stack.url, NS, staging_bytes=1 << 20) as client:
        assert client.save(tokens, kv) == 40
        # a rogue one-sided write flips bytes of block 2 inside the worker's memory
        hit = client.directory.lookup(NS.namespace_id, [h.hex() for h in block_hashes(NS, tokens)], locations=True).blocks[2]
        addr, length = hit.location.runs[0]
        garbage = np.full(64, 0xAB, dtype=np.uint8)
        client.register_buffer(garbage)
        peer = client.peers.agent_for(hit.location.worker, hit.location.epoch)
        rows = np.array([(int(garbage.ctypes.data), 64)], dtype=np.uint64)
        assert client.agent.submit("WRITE", rows, np.array([(addr, 64)], dtype=np.uint64), peer).wait() == "done"

        loaded, n = client.load(tokens)
        assert n == 16  # blocks 0 and 1 only
        for (k, v), (lk, lv) in zip(kv, loaded):
            assert torch.equal(lk, k[:, :16]) and torch.equal(lv, v[:, :16])
        assert client.lookup(tokens) == 16  # the bad replica was invalidated
        # a reader that reports intact blocks bad is not believed: the worker checks their bytes
        hashes = [h.hex() for h in block_hashes(NS, tokens)[:2]]
        load = client.directory.prepare_load(specs.PrepareLoad(namespace_id=NS.namespace_id, hashes=hashes))
        lie = specs.CompleteLoad(token=load.token, blocks=[specs.BlockRead(hash=h, ok=False) for h in hashes])
        assert client.directory.complete_load(lie).invalidated == 0
        assert client.lookup(tokens) == 16
        stats = client.directory.stats()
        assert (stats.pins, stats.leases_active) == (0, 0)
    metrics = __import__("httpx").get(running_stack.url + "/metrics").text
    assert "kvstore_checksum_failures_total 1.0" in metrics
