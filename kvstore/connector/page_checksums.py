"""Checksums of blocks in vLLM's paged KV buffer, as the store keeps them: xxh3_64 of a block's page
of every layer, in layer order.

    block_checksums(caches, layer_names, block_ids) -> [hex]
    tail = LayerwiseChecksum(num_layers)   # one block, hashed a layer at a time as each arrives
    tail.add(index, page); tail.hexdigest() -> hex | None
    hashes = CopyHashes(block_ids, num_layers)  # blocks hashed as their pages are copied, layer by layer
    hashes.for_layer(block_id, layer) -> hasher | None; hashes.spoil(ids); hashes.hexdigest(block_id)
    checksums(caches, layer_names, block_ids, hashes) -> [hex]   # hashes' where it has them, else gathered
"""

from __future__ import annotations

import torch
import xxhash

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
            pages = caches[layer].index_select(0, index).cpu().reshape(len(group), -1).view(torch.uint8)
            for hasher, page in zip(hashers, pages.numpy()):
                hasher.update(page)
        out += [h.hexdigest() for h in hashers]
    return out


def checksums(caches: dict[str, torch.Tensor], layer_names: list[str], block_ids: list[int],
              hashes: CopyHashes | None) -> list[str]:
    """Each block's checksum: taken while its pages were copied when `hashes` has it, else from the pages."""
    sums = [hashes.hexdigest(b) if hashes is not None else None for b in block_ids]
    rest = iter(block_checksums(caches, layer_names, [b for b, s in zip(block_ids, sums) if s is None]))
    return [s if s is not None else next(rest) for s in sums]


class LayerwiseChecksum:
    """The checksum of one block whose page is hashed layer by layer, each before the forward writes
    into it (a hand-off's partial last block: the consumer computes the prompt's last token there)."""

    def __init__(self, num_layers: int) -> None:
        self._hash, self._layers, self._num_layers = xxhash.xxh3_64(), 0, num_layers

    def add(self, index: int, page: torch.Tensor) -> None:
        """Layer `index`'s page; a layer out of order (one was skipped, or this one was seen) is not hashed."""
        if index == self._layers:
            self._hash.update(page.cpu().reshape(-1).view(torch.uint8).numpy())
            self._layers += 1

    def hexdigest(self) -> str | None:
        """None unless every layer was hashed."""
        return self._hash.hexdigest() if self._layers == self._num_layers else None


class CopyHashes:
    """Checksums of blocks whose pages are copied layer by layer (the same-host path): each page is
    hashed right after its copy. A block has one only if every layer was hashed, in layer order,
    once; otherwise its checksum is taken from the pages (`block_checksums`)."""

    def __init__(self, block_ids: list[int], num_layers: int) -> None:
        self._num_layers = num_layers
        self._next = {block_id: 0 for block_id in block_ids}  # the layer expected next; -1: spoilt
        self._hashers = {block_id: xxhash.xxh3_64() for block_id in block_ids}

    def for_layer(self, block_id: int, layer: int):
        """The hasher to feed this block's page of `layer`, or None (the block then has no checksum here)."""
        if self._next.get(block_id) != layer:
            self.spoil([block_id])
            return None
        self._next[block_id] = layer + 1
        return self._hashers[block_id]

    def spoil(self, block_ids) -> None:
        """These blocks' pages went another way (NIXL): no checksum from here."""
        for block_id in block_ids:
            self._next[block_id] = -1

    def hexdigest(self, block_id: int) -> str | None:
        return self._hashers[block_id].hexdigest() if self._next.get(block_id) == self._num_layers else None
