"""What operators ask of a directory replica: tiers, stats, metrics, evictions, a database ping.

    admin.tiers() / admin.stats() / admin.metrics_text()
    admin.evict(namespace_id | None, dry_run)   # every visible replica (of one namespace); pinned ones when unpinned
    admin.evict_tier(EvictRequest)              # down the tiers, as the tier's policy orders them
    admin.ping_database()                       # raises when the database does not answer
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.tiers import MEMORY
from kvstore.directory.db import repository as repo
from kvstore.directory.db.changelog import term
from kvstore.directory.db.index import Index
from kvstore.directory.db.models.replica import DELETING
from kvstore.directory.db.writer import Tx, Writer
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.moves.tiers import Movement
from kvstore.directory.role import Role
from kvstore.directory.saves.reservations import Reservations
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.membership import Membership
from kvstore.directory.workers.reclaim import Reclaim

if TYPE_CHECKING:
    from kvstore.directory.db.engine import Session, sessionmaker

log = logging.getLogger(__name__)


class Admin:
    def __init__(self, sessions: sessionmaker[Session], writer: Writer, index: Index, role: Role,
                 movement: Movement, reclaim: Reclaim, reservations: Reservations, pools: PagePools,
                 membership: Membership, metrics: DirectoryMetrics) -> None:
        self._sessions = sessions
        self._writer = writer
        self._index = index
        self._role = role
        self._movement = movement
        self._reclaim = reclaim
        self._reservations = reservations
        self._pools = pools
        self._membership = membership
        self._metrics = metrics

    def evict_tier(self, req: specs.EvictRequest) -> specs.Evicted:
        workers = self._index.workers  # the topology as of the last commit: no job to read it
        targets = sorted((t.id, w.id) for t in self._index.tiers.values() for w in [workers.get(t.worker_id)]
                         if t.kind == req.tier and w and w.state == "active" and req.worker in (None, w.name))
        if req.worker is not None and not targets:
            raise KVStoreError("not_found", f"no active worker {req.worker!r} with a {req.tier} tier",
                               worker=req.worker, tier=req.tier)
        total = {"replicas": 0, "bytes": 0, "demoted": 0, "dropped": 0}
        for tier_id, worker_id in targets:
            left = None if req.bytes is None else req.bytes - total["bytes"]
            if (left is not None and left <= 0) or req.limit <= total["replicas"]:
                break
            outcome = self._movement.evict(tier_id, worker_id, left, req.namespace_id,
                                           req.limit - total["replicas"], req.dry_run)
            total = {k: total[k] + outcome[k] for k in total}
        return specs.Evicted(**total)

    def evict(self, namespace_id: str | None, dry_run: bool = False) -> specs.Evicted:
        """Drop every visible replica (of one namespace, or all). Pinned ones go when unpinned."""
        def job(tx: Tx) -> specs.Evicted:
            rows = repo.visible_replica_rows(tx.session, namespace_id)
            if not dry_run:
                for replica in rows:
                    replica.state = DELETING
                self._reclaim.collect_deleting(tx)
            return specs.Evicted(replicas=len(rows), bytes=sum(r.reserved_bytes for r in rows), dropped=len(rows))
        evicted = self._writer.run(job)
        if not dry_run:
            log.info("evicted %d replicas%s", evicted.replicas, f" of namespace {namespace_id}" if namespace_id else "")
        return evicted

    def tiers(self) -> list[specs.TierUsage]:
        leading = self._role.leading
        with self._sessions() as session:
            return [specs.TierUsage(worker=w.name, kind=t.kind, capacity_bytes=t.capacity_bytes,
                                    used_bytes=t.used_bytes + self._reservations.reserved_bytes(t.id), num_blocks=n,
                                    kv_bytes=kv, block_bytes=held, page_bytes=t.page_bytes,
                                    high_watermark=t.high_watermark, low_watermark=t.low_watermark,
                                    credit_free_bytes=self._pools.free_bytes(t.id, w.epoch)
                                    if t.kind in MEMORY and leading else None)
                    for t, w, n, kv, held in repo.tier_usage(session)]

    def metrics_text(self) -> bytes:
        """Prometheus' text: the counters, the stats, and (on the leader) tiers and workers."""
        leading = self._role.leading
        return self._metrics.render(self.stats(), self.tiers() if leading else [], self._membership.workers())

    def ping_database(self) -> None:
        """Raises when the database does not answer a trivial query."""
        with self._sessions() as session:
            repo.ping(session)

    def stats(self) -> specs.Stats:
        with self._sessions() as session:
            counts = repo.counts(session)  # its reservations are the moves' destinations
            counts["reservations"] += self._reservations.blocks
            return specs.Stats(**counts, replicas_by_tier=repo.replicas_by_tier(session),
                               indexed_blocks=self._index.num_blocks, leader=self._role.leading,
                               term=term(session) or 0, follower_lag_s=round(self._role.lag_s, 3),
                               commit_groups=self._writer.groups, committed_jobs=self._writer.jobs)
