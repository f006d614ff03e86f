"""One layer of many stored blocks, posted: the same-host copy or the NIXL request, for both the
vLLM connector and `KVStoreClient`'s layer-wise loads.

    side = LayerSide(base, step, start, end, memory, cache)   # where this process holds the layer
    transfers, local = post_layer(op, groups, side, arenas, agent, pool, hashes, threads, after)

For each group (the blocks in one storage worker's tier, `layer_copies.by_worker`), block b's
layer lies here at `base + b x step` and is bytes [start, end) of the stored block. Where the
worker's arena is mapped (`arenas.view`, the one place that decides), the layer is copied with it:
on the copy threads for host memory, by the GPU for GPU memory (`cache` given); a load's blocks
(`hashes` given) are hashed in the arena beside the copy. Elsewhere, or where the GPU cannot
address the arena, it is one NIXL request to the worker (None: the worker's agent is unknown).
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import NamedTuple

import torch

from kvstore.connector.arenas import Arena, LocalArenas
from kvstore.connector.gpu_copies import gpu_copy_layer
from kvstore.connector.layer_copies import COPY_THREADS, BlockGroup, HostMemory
from kvstore.connector.nixl_rows import remote_side, slice_rows
from kvstore.connector.page_checksums import ArenaHashes
from kvstore.transfer import Agent


class LayerSide(NamedTuple):
    """Where this process holds one layer of the blocks: block b's bytes [start, end) of the stored
    block at base + b x step, in `memory` (host) or in `cache`'s GPU allocation."""
    base: int
    step: int
    start: int
    end: int
    memory: HostMemory
    cache: torch.Tensor | None = None  # GPU pages: the layer's cache tensor


def post_layer(op: str, groups: list[BlockGroup], side: LayerSide, arenas: LocalArenas, agent: Agent,
               pool: Executor, hashes: ArenaHashes | None = None, layer: int = 0, num_layers: int = 1,
               threads: int = COPY_THREADS, after: torch.cuda.Event | None = None) -> tuple[list, int]:
    """`op` ("READ" into here, "WRITE" from here) of layer `layer` (of `num_layers`) for every group;
    returns one transfer per group (a copy or a NIXL request, None when nothing could be posted)
    and how many were copies. `hashes`: a load's, fed with the blocks copied with an arena."""
    transfers, local = [], 0
    for group in groups:
        arena = arenas.view(group.items[0][1])  # DRAM tiers of this host's workers only
        copy = _copy(op, group, side, arena, pool, threads, after) if arena is not None else None
        if copy is not None:
            local += 1
            transfers.append(copy)
            if hashes is not None:  # a load's blocks, hashed in the arena beside the copies
                hashes.copied(group.blocks, layer, arena)
                hashes.hash([b for b, _ in group.blocks[layer::num_layers]], pool)
            continue
        if hashes is not None:
            hashes.spoil(block_id for block_id, _ in group.blocks)
        transfers.append(_nixl(op, group, side, agent))
    return transfers, local


def _copy(op: str, group: BlockGroup, side: LayerSide, arena: Arena, pool: Executor, threads: int,
          after: torch.cuda.Event | None):
    """The group's layer copied with its worker's mapped arena; None where the GPU cannot address it."""
    if side.cache is not None and side.cache.is_cuda:
        return gpu_copy_layer(op, group.pages(side.base, side.step), side.start, side.end, side.cache, arena, after)
    return group.copier.copy(op, side.base, side.step, side.start, side.end, side.memory, arena, pool, threads)


def _nixl(op: str, group: BlockGroup, side: LayerSide, agent: Agent):
    if group.peer is None:
        return None
    on_gpu = side.cache is not None and side.cache.is_cuda
    device = (side.cache.device.index or 0) if on_gpu else None
    local, remote = slice_rows(group.pages(side.base, side.step), side.start, side.end, device)
    remote, remote_mem = remote_side(remote, group.items[0][1])  # an HBM tier: its GPU's memory
    return agent.submit(op, local, remote, group.peer, "VRAM" if on_gpu else "DRAM", remote_mem)
