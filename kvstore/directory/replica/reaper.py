"""The leader's periodic round: what expired goes, then blocks move.

    reaper.reap() -> counts   # one round at a time, whoever calls (the background thread, tests)

In order: expired leases and reservations, sources left MOVING by a move whose
last step failed (READY again once its destination expired), workers silent past their heartbeat
timeout (declared dead), drains that finished, hand-offs past their keep time,
deleted replicas freed; then moves whose answer was lost, access statistics
flushed to SQL, page credit asked of workers that gave none, drains (onto other
workers first, then a tier down), demotion, write-through and copies for
replicated namespaces.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.directory.db import repository as repo
from kvstore.directory.db.models.replica import READY, WRITING
from kvstore.directory.db.writer import Tx, Writer, forget_marks
from kvstore.directory.handoffs import Handoffs
from kvstore.directory.loads.loads import Loads
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.db import moves as moves_sql
from kvstore.directory.moves.orphans import Orphans
from kvstore.directory.moves.spread import Spread
from kvstore.directory.moves.tiers import Movement
from kvstore.directory.saves.store import Store
from kvstore.directory.workers.membership import Membership
from kvstore.directory.workers.reclaim import Reclaim

log = logging.getLogger(__name__)
MARKS_KEPT_S = 3600.0  # commit marks are asked about within seconds of their commit


class Reaper:
    def __init__(self, writer: Writer, reclaim: Reclaim, membership: Membership, handoffs: Handoffs, store: Store,
                 loads: Loads, orphans: Orphans, spread: Spread, movement: Movement, metrics: DirectoryMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self._writer = writer
        self._reclaim = reclaim
        self._membership = membership
        self._handoffs = handoffs
        self._store = store
        self._loads = loads
        self._orphans = orphans
        self._spread = spread
        self._movement = movement
        self._metrics = metrics
        self._clock = clock
        self._reaping = threading.Lock()

    def reap(self) -> dict[str, int]:
        """Expire leases and reservations, declare silent workers dead, free deleted replicas, flush
        access statistics, then move blocks (demotion, drains, write-through)."""
        with self._reaping:  # one round at a time, whoever calls
            return self._reap()

    def flush(self) -> None:
        """Every access statistic not yet in SQL goes there, after a round still running."""
        with self._reaping:
            self._loads.flush_accesses(rows=None)

    def _reap(self) -> dict[str, int]:
        def job(tx: Tx) -> tuple[int, int, int, list[int]]:
            now = self._clock()
            leases = repo.delete_expired_leases(tx.session, now)
            forget_marks(tx.session, now - MARKS_KEPT_S)
            tokens = repo.expired_reservations(tx.session, now)  # moves' destinations
            for token in tokens:
                rows = repo.replicas_with_token(tx.session, token, WRITING)
                self._reclaim.drop(tx, [(r, t, w) for r, _, t, w in rows])
            for replica in moves_sql.stranded_moving(tx.session):
                replica.state = READY  # readable and evictable again
            dead = self._membership.declare_dead(tx, now)
            draining = self._membership.finish_drains(tx)
            self._handoffs.expire(tx, now)
            if leases or tokens or dead:
                self._reclaim.collect_deleting(tx)
            return leases, len(tokens) + self._store.expire(tx, now), dead, draining
        leases, tokens, dead, draining = self._writer.run(job)
        if dead:
            self._metrics.declared_dead.inc(dead)
        if leases or tokens or dead:
            log.info("reaper: %d expired pins, %d expired reservations, %d dead workers", leases, tokens, dead)
        settled = self._orphans.settle()  # moves whose answer was lost, whose workers have stopped them
        self._loads.flush_accesses()
        for worker_id in self._membership.ungranted():
            self._membership.grant(worker_id)
        drained = sum(self._spread.drain(w) for w in draining)  # onto other workers first
        drained += self._movement.drain(draining) if draining else 0  # what found no room there: a tier down
        demoted = self._movement.demote()
        copied = self._movement.write_through()
        replicated = self._spread.replicate()
        return {"leases": leases, "reservations": tokens + settled, "dead_workers": dead, "drained": drained,
                "demoted": demoted, "written_through": copied, "replicated": replicated}
