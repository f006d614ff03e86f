"""A prefix's blocks as operators inspect them: which are stored, where each replica is, its pins.

    prefix_hashes(namespace, token_ids, seed) -> [hex]   # the namespace's own scheme, vLLM's included
    inspect(sessions, namespace_id, block_tokens, hashes, block_ids) -> InspectResult
"""

from __future__ import annotations

from kvstore.core import inspection, specs, vllm_hashes
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import HASH_SCHEME, Namespace, block_hashes
from kvstore.directory.db import repository as repo


def prefix_hashes(namespace: Namespace, token_ids: list[int], seed: str | None = None,
                  max_blocks: int = specs.MAX_BLOCKS) -> list[str]:
    """The hex hashes of every full block of `token_ids`, as the namespace's engines name them."""
    if len(token_ids) // namespace.block_tokens > max_blocks:
        raise KVStoreError("invalid", f"{len(token_ids)} token ids are more than {max_blocks} blocks of "
                           f"{namespace.block_tokens} tokens; give a shorter prefix")
    if namespace.hash_scheme == HASH_SCHEME:
        return [h.hex() for h in block_hashes(namespace, token_ids)]
    if vllm_hashes.parse_scheme(namespace.hash_scheme) is not None:
        return vllm_hashes.block_hashes(namespace.hash_scheme, namespace.block_tokens, token_ids, seed)
    raise KVStoreError("invalid", f"this namespace's block hashes come from its engine ({namespace.hash_scheme}), "
                       "which the store cannot compute: give the hashes", hash_scheme=namespace.hash_scheme)


def inspect(sessions, namespace_id: str, block_tokens: int, hashes: list[str],
            block_ids=lambda namespace_id, hashes: {}) -> inspection.InspectResult:
    """`block_ids`: the lookup index's (namespace, hashes) -> {hash: id}; the blocks it does not hold
    (none of their replicas readable) are looked for by a scan: no SQL index serves hashes."""
    with sessions() as session:
        known = block_ids(namespace_id, hashes)
        by_id = repo.blocks_by_id(session, list(known.values()))
        blocks = {h: by_id[i] for h, i in known.items() if i in by_id}
        missing = [h for h in hashes if h not in blocks]
        if missing:
            blocks.update(repo.blocks_by_hash(session, namespace_id, missing))
        rows = repo.replicas_of(session, [b.id for b in blocks.values()])
        pins = repo.pin_counts(session, [r.id for r, _, _ in rows])
    by_block: dict[int, list[inspection.ReplicaInfo]] = {}
    for replica, tier, worker in rows:
        by_block.setdefault(replica.block_id, []).append(inspection.ReplicaInfo(
            worker=worker.name, tier=tier.kind, state=replica.state, epoch=replica.epoch,
            nbytes=replica.reserved_bytes, pins=pins.get(replica.id, 0)))
    out = []
    for position, block_hash in enumerate(hashes):
        block = blocks.get(block_hash)
        if block is None:
            out.append(inspection.BlockInfo(position=position, hash=block_hash, stored=False))
            continue
        replicas = sorted(by_block.get(block.id, []), key=lambda r: (r.tier, r.worker))
        out.append(inspection.BlockInfo(position=position, hash=block_hash, stored=True, nbytes=block.nbytes,
                                        hit_count=block.hit_count, last_access=block.last_access,
                                        replicas=replicas))
    return inspection.InspectResult(namespace_id=namespace_id, block_tokens=block_tokens, blocks=out)
