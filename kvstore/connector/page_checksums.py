"""Checksums of blocks in vLLM's paged KV buffer, as the store keeps them: xxh3_64 of a block's page
of every layer, in layer order, each page's bytes as they lie in memory.

    block_checksums(caches, layer_names, block_ids) -> [hex]
    tail = LayerwiseChecksum(num_layers)   # one block, hashed a layer at a time as each arrives
    tail.add(index, page); tail.hexdigest() -> hex | None
    hashes = ArenaHashes(block_ids, num_layers)  # a load's blocks copied out of a mapped arena, hashed there
    hashes.copied([(id, runs)], layer, arena); hashes.spoil(ids); hashes.hash(ids, pool); hashes.hexdigest(id)
    checksums(caches, layer_names, block_ids, hashes) -> [hex]   # hashes' where it has them, else gathered
    saved_checksums(caches, layer_names, block_ids, memory, pool, tasks) -> [hex]  # a save's, from its pages

A save hashes its own pages, what it meant to write, never the arena it copied them to: a stale
writer (a reservation dropped under it, still copying) or another engine may have written there
since, and the next load must find that out.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import torch
import xxhash

from kvstore.connector.arenas import arena_digest

CHECKSUM_GROUP = 256  # blocks whose pages of one layer are gathered at once


def block_checksums(caches: dict[str, torch.Tensor], layer_names: list[str], block_ids: list[int]) -> list[str]:
    """Pages are gathered per layer, CHECKSUM_GROUP blocks at a time: one gather (on a GPU, one
    device-to-host copy) per layer and group rather than one per page."""
    out = []
    for start in range(0, len(block_ids), CHECKSUM_GROUP):
        group = block_ids[start:start + CHECKSUM_GROUP]
        hashers = [xxhash.xxh3_64() for _ in group]
        index = torch.tensor(group, device=caches[layer_names[0]].device)
        for layer in layer_names:
            pages = in_memory_order(caches[layer]).index_select(0, index).cpu().reshape(len(group), -1)
            pages = pages.view(torch.uint8)
            for hasher, page in zip(hashers, pages.numpy()):
                hasher.update(page)
        out += [h.hexdigest() for h in hashers]
    return out


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t` with its dimensions in memory order (largest stride first; a page of vLLM's NHD layout is
    a [heads, tokens, ..] view of [tokens, heads, ..] bytes): its contiguous copy is the bytes as
    they lie in memory, which is what the store holds and hashes."""
    return t.permute(*sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def checksums(caches: dict[str, torch.Tensor], layer_names: list[str], block_ids: list[int],
              hashes: ArenaHashes | None) -> list[str]:
    """Each block's checksum: taken in the arena it was copied with when `hashes` has it, else from the pages."""
    sums = [hashes.hexdigest(b) if hashes is not None else None for b in block_ids]
    rest = iter(block_checksums(caches, layer_names, [b for b, s in zip(block_ids, sums) if s is None]))
    return [s if s is not None else next(rest) for s in sums]


def saved_checksums(caches: dict[str, torch.Tensor], layer_names: list[str], block_ids: list[int], memory,
                    pool: Executor, tasks: int = 1) -> list[str]:
    """Each block's checksum taken from the engine's pages: host pages where they lie (`memory`:
    the registered pages as numpy views; one xxh3 pass, `tasks` tasks on `pool`), GPU pages
    gathered to the host (`block_checksums`)."""
    caches_in_order = [caches[name] for name in layer_names]
    if not block_ids or caches_in_order[0].is_cuda:
        return block_checksums(caches, layer_names, block_ids)
    layers = [(c.data_ptr(), c.stride(0) * c.element_size(), c[0].nbytes) for c in caches_in_order]

    def share(ids: list[int]) -> list[str]:
        out = []
        for block_id in ids:
            hasher = xxhash.xxh3_64()
            for base, step, page in layers:
                hasher.update(memory.view(base + block_id * step, page))
            out.append(hasher.hexdigest())
        return out

    parts = [block_ids[i::tasks] for i in range(min(tasks, len(block_ids)))]
    sums = [pool.submit(share, part) for part in parts]
    out = [""] * len(block_ids)
    for i, future in enumerate(sums):
        out[i::len(parts)] = future.result()
    return out


class LayerwiseChecksum:
    """The checksum of one block whose page is hashed layer by layer, each before the forward writes
    into it (a hand-off's partial last block: the consumer computes the prompt's last token there)."""

    def __init__(self, num_layers: int) -> None:
        self._hash, self._layers, self._num_layers = xxhash.xxh3_64(), 0, num_layers

    def add(self, index: int, page: torch.Tensor) -> None:
        """Layer `index`'s page; a layer out of order (one was skipped, or this one was seen) is not hashed."""
        if index == self._layers:
            self._hash.update(in_memory_order(page).cpu().reshape(-1).view(torch.uint8).numpy())
            self._layers += 1

    def hexdigest(self) -> str | None:
        """None unless every layer was hashed."""
        return self._hash.hexdigest() if self._layers == self._num_layers else None


class ArenaHashes:
    """Checksums of a load's blocks copied layer by layer out of a worker's mapped arena (the
    same-host path), taken in the arena, where a block is its runs one after the other: one xxh3
    pass per block (xxhash releases the GIL for it, a 64 KiB page at a time it does not), on the
    copy threads, beside the copies (a lease keeps those bytes unchanged). A block has a checksum
    here only if every layer went through one arena, once each, in layer order; otherwise it is
    taken from the pages."""

    def __init__(self, block_ids: list[int], num_layers: int) -> None:
        self._num_layers = num_layers
        self._next = {block_id: 0 for block_id in block_ids}  # the layer expected next; -1: spoilt
        self._where: dict[int, tuple[object, list[tuple[int, int]]]] = {}  # block id -> (arena, runs)
        self._digests: dict[int, tuple[Future, int]] = {}  # block id -> (its share's hashes, its index there)

    def copied(self, blocks: list[tuple[int, list[tuple[int, int]]]], layer: int, arena) -> None:
        """These (block id, runs) have their page of `layer` copied with `arena`, where they are `runs`."""
        for block_id, runs in blocks:
            if self._next.get(block_id) != layer or (layer and self._where[block_id][0] is not arena):
                self._next[block_id] = -1
                continue
            if not layer:
                self._where[block_id] = (arena, runs)
            self._next[block_id] = layer + 1

    def spoil(self, block_ids) -> None:
        """These blocks' pages went another way (NIXL): no checksum from here."""
        for block_id in block_ids:
            self._next[block_id] = -1

    def hash(self, block_ids, pool: Executor, tasks: int = 1) -> None:
        """Start hashing these blocks in their arena, as `tasks` tasks (a save: only once its copies ended)."""
        share = [b for b in block_ids if b in self._where and b not in self._digests and self._next[b] != -1]
        for part in (share[i::tasks] for i in range(min(tasks, len(share)))):
            where = [self._where[b] for b in part]
            future = pool.submit(lambda where=where: [arena_digest(arena, runs) for arena, runs in where])
            self._digests.update((b, (future, k)) for k, b in enumerate(part))

    def hexdigest(self, block_id: int) -> str | None:
        if self._next.get(block_id) != self._num_layers:
            return None
        if block_id in self._digests:
            future, k = self._digests[block_id]
            return future.result()[k]
        return arena_digest(*self._where[block_id])
