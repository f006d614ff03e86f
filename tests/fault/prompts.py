"""Prompts of random KV saved and loaded through a KVStoreClient's registered staging memory, for
the fault tests that check every byte comes back."""

from __future__ import annotations

import numpy as np

from kvstore.connector import KVStoreClient
from kvstore.core.keys import Namespace, block_hashes

NS = Namespace(model_id="restart", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=16)
BLOCKS_PER_PROMPT = 4


def prompt(seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, BLOCKS_PER_PROMPT * NS.block_tokens).tolist()
    blocks = [rng.standard_normal(NS.block_nbytes // 4, dtype=np.float32).view(np.uint8)
              for _ in range(BLOCKS_PER_PROMPT)]
    return block_hashes(NS, tokens), blocks


def save(client: KVStoreClient, hashes, blocks) -> int:
    views = client._staging_views(len(blocks))  # registered memory
    for view, block in zip(views, blocks):
        view[:] = block
    return client.save_blocks(hashes, views)


def load(client: KVStoreClient, hashes) -> tuple[int, list[np.ndarray]]:
    views = client._staging_views(len(hashes))
    n = client.load_blocks(hashes, views)
    return n, [v.copy() for v in views[:n]]
