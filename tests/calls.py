"""The directory's calls as the component tests make them: a chain of hashes, a save prepared and
completed, lookups and loads through a stack's client (`tests.stacks`)."""

from __future__ import annotations

from kvstore.core import specs
from kvstore.core.keys import block_hashes
from tests.stacks import NS

BLOCK = NS.block_nbytes  # 256 bytes = 2 pages of 128


def chain(n: int, start: int = 0) -> list[str]:
    return [h.hex() for h in block_hashes(NS, list(range(start, start + 4 * n)))]


def prepare(stack, hashes, parent=None) -> specs.StorePrepared:
    parents = [parent] + hashes[:-1]
    return stack.client.prepare_store(specs.PrepareStore(namespace_id=stack.namespace_id, blocks=[
        specs.BlockToStore(hash=h, parent=p, nbytes=BLOCK) for h, p in zip(hashes, parents)]))


def complete(stack, prepared, ok=True):
    return stack.client.complete_store(specs.CompleteStore(token=prepared.token, blocks=[
        specs.BlockWritten(hash=b.hash, ok=ok, checksum="0123456789abcdef")
        for b in prepared.blocks if b.status == "admitted"]))


def hits(stack, hashes) -> int:
    return stack.client.lookup(stack.namespace_id, hashes).num_hit_blocks


def read(stack, hashes) -> int:
    """Load the prefix as an engine does (pin, read, release): an access, unlike a lookup."""
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes))
    if load.token:
        stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=[
            specs.BlockRead(hash=b.hash, ok=True) for b in load.blocks]))
    return len(load.blocks)
