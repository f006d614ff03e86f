"""Checksums of blocks in vLLM's paged KV buffer, as the store keeps them: xxh3_64 of a block's page
of every layer, in layer order.

    block_checksums(caches, layer_names, block_ids) -> [hex]
    tail = LayerwiseChecksum(num_layers)   # one block, hashed a layer at a time as each arrives
    tail.add(index, page); tail.hexdigest() -> hex | None
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
