"""What a save is checked against: before it is prepared (sizes, hashes once) and, with
`verify_writes`, before it is committed (the worker recomputes each block's checksum)."""

from __future__ import annotations

import logging

from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace
from kvstore.directory import wire
from kvstore.directory.db.index import Index
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.saves.reservations import Reservations
from kvstore.directory.workers.calls import WorkerCalls

log = logging.getLogger(__name__)


def check_blocks(namespace: Namespace, blocks) -> None:
    """Every block has the namespace's size, and no hash comes twice."""
    expected = namespace.block_nbytes
    wrong = [b.hash for b in blocks if b.nbytes != expected]
    if wrong:
        raise KVStoreError("invalid", f"blocks of this namespace are {expected} bytes",
                           expected=expected, wrong_hashes=wrong[:5])
    seen: set[str] = set()
    twice = [b.hash for b in blocks if b.hash in seen or seen.add(b.hash)]
    if twice:
        raise KVStoreError("invalid", "a hash appears more than once in one request", duplicate_hashes=twice[:5])


def verified(req: wire.CompleteStore, reservations: Reservations, index: Index, calls: WorkerCalls,
             metrics: DirectoryMetrics) -> wire.CompleteStore:
    """The writer's report, with every block its worker does not find matching the reported
    checksum marked failed (so it is not committed). Asked before the commit, outside every job."""
    r = reservations.get(req.token)
    worker = index.workers.get(r.worker_id) if r else None
    tier = index.tiers.get(r.tier_id) if r else None
    claimed = {b.hash: b.checksum for b in req.blocks if b.ok and b.checksum}
    written = [b for b in r.blocks if b.hash in claimed] if worker and tier else []
    if not written:
        return req  # nothing to check; completing says what is wrong with the token
    replicas = [(tier.kind, b.runs, b.nbytes, claimed[b.hash]) for b in written]
    matches = calls.verify(worker.control_url, replicas)
    bad = {b.hash for b, match in zip(written, matches) if match is not True}
    if not bad:
        return req
    log.warning("%d of %d blocks written under %s do not match their writer's checksum; not committed",
                len(bad), len(written), req.token[:8])
    metrics.checksum_failures.inc(len(bad))
    return wire.CompleteStore(token=req.token, blocks=[
        wire.BlockWritten(hash=b.hash, ok=b.ok and b.hash not in bad, checksum=b.checksum) for b in req.blocks])
