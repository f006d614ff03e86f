"""A directory replica's hot calls, checked (the caller's namespace, its tenants), and the replica as
its election sees it (start, follow, step down). `process/build.py` wires its parts; namespaces and
operators' calls are the directory's `namespaces.py` and `admin.py`.

Calls, in the order a block lives through them:
    start()                                             # recover, rebuild index and page pools (readyz)
    prepare_store_async -> complete_store_async | abort_store   (WRITING -> READY, or rolled back)
    lookup                                              (the in-memory index: no lock, no SQL)
    prepare_loads -> complete_loads                     (promotes to memory if needed; pins under a lease)
    commit_handoff / wait_handoff                       (a prefill engine's saves, awaited by a decode engine)
    reap()                                              (expired leases, reservations and workers; moves)

Every change to SQL is a job on the one writer (`db/writer.py`, group commit);
worker calls are made outside jobs. Among several directory replicas, the
writer's commits are checked and logged by `db/changelog.py` and the election
is `leader.py`, which calls `start`, `follow_from`, `apply` and `write` here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.core import specs
from kvstore.core.handoffs import HandoffCommit, HandoffState, HandoffWait
from kvstore.core.inspection import MAX_INSPECTED, InspectRequest, InspectResult
from kvstore.directory.db import repository as repo
from kvstore.directory.db.changelog import ChangeLog, Changes
from kvstore.directory.db.index import Index
from kvstore.directory.db.models.replica import MOVING, READY, WRITING
from kvstore.directory.db.writer import Tx, Writer
from kvstore.directory.handoffs import Handoffs
from kvstore.directory.loads import inspection
from kvstore.directory.loads.inspection import prefix_hashes
from kvstore.directory.loads.loads import Loads
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.moves.tiers import Movement
from kvstore.directory.namespaces import Namespaces
from kvstore.directory.replica.reaper import Reaper
from kvstore.directory.saves.checks import check_blocks, verified
from kvstore.directory.saves.reservations import Reservations
from kvstore.directory.saves.store import Store
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.tier_policies import TierPolicies
from kvstore.directory.workers.calls import WorkerCalls
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.membership import Membership
from kvstore.directory.workers.reclaim import Reclaim

if TYPE_CHECKING:
    from kvstore.directory.db.engine import Session, sessionmaker

log = logging.getLogger(__name__)


class DirectoryService:
    """Built by `process/build.py`, which hands it the parts it calls; they stay readable as attributes."""

    def __init__(self, *, settings: DirectorySettings, sessions: sessionmaker[Session], changelog: ChangeLog,
                 metrics: DirectoryMetrics, writer: Writer, index: Index, policies: TierPolicies, pools: PagePools,
                 calls: WorkerCalls, reclaim: Reclaim, reservations: Reservations, store: Store, loads: Loads,
                 handoffs: Handoffs, membership: Membership, movement: Movement, reaper: Reaper,
                 namespaces: Namespaces, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.sessions, self.changelog, self.metrics = settings, sessions, changelog, metrics
        self.writer, self.index, self.policies, self.pools, self.calls = writer, index, policies, pools, calls
        self.reservations, self.store, self.loads, self.handoffs = reservations, store, loads, handoffs
        self.membership, self.movement, self.reaper, self.namespaces = membership, movement, reaper, namespaces
        self._reclaim = reclaim
        self._clock = clock
        self._starting = False  # the index is built again, then the page credit: not ready until both are

    @property
    def leading(self) -> bool:
        """Among several directory replicas, whether this one writes."""
        return self.changelog.role.leading

    def reap(self) -> dict[str, int]:
        """The reaper's round (`reaper.py`), after the index reads back what it still owes (on the
        writer's thread, which alone updates the index)."""
        if self.index.owes:
            self.writer.run(lambda tx: self.index.follow_commit(self.sessions, set(), False, []))
        return self.reaper.reap()

    # ---- start -------------------------------------------------------------------------------

    def start(self, rebuild_index: bool = True) -> None:
        """Recover from the stop, then build the index, the page pools and the namespaces from SQL
        (a follower that becomes the leader has its index already: it followed every commit)."""
        self.recover()
        t0 = time.perf_counter()
        self._starting = rebuild_index  # a promoted follower's index serves lookups meanwhile
        try:
            self.writer.run(lambda tx: self._build(tx, rebuild_index))  # nothing commits while SQL is read
        finally:
            self._starting = False
        log.info("index of %d blocks and page credit built in %.1f s", self.index.num_blocks, time.perf_counter() - t0)

    def _build(self, tx: Tx, rebuild_index: bool) -> None:
        self.namespaces.load(tx.session)
        for worker in repo.workers(tx.session):
            if worker.state != "dead":  # a dead row may name the endpoint a live worker has now
                self.calls.authorize(worker.control_url, worker.control_secret)
        if rebuild_index:
            self.index.rebuild(tx.session)
            repo.merge_blocks(tx.session, self.index.duplicates)  # the leader's to resolve: it alone writes
        else:
            self.index.reload_topology(tx.session)
        self.pools.rebuild(tx.session, self.index.tiers, self.index.workers)

    def step_down(self) -> None:
        """This replica no longer leads: what only the leader holds in memory goes (open reservations
        and remembered completions, page credit, heartbeats heard). Another replica holds them now,
        in SQL; a later promotion of this one builds them from there again (`start`)."""
        self.store.forget_open()
        self.pools.clear()
        self.membership.forget_beats()

    def excuse_silence(self) -> None:
        """After this leader's connection dropped (the database went away): no heartbeat could be
        recorded meanwhile, so each live worker gets a full heartbeat timeout from now, as at a
        start (`recover`). Else the outage would declare every worker dead and drop its DRAM."""
        self.writer.run(lambda tx: self.membership.excuse(tx, self._clock()))

    def reread(self, adopt: Callable[[Session], None]) -> None:
        """After a database restart that may have lost relaxed commits (saves): index, page credit
        (the pages of lost blocks come back) and policies from SQL, open reservations dropped; alone
        in its group, so that no job made on the old state shares its commit."""
        t0 = time.perf_counter()

        def job(tx: Tx) -> None:
            with self.store.paused():
                self._build(tx, True)
            for tier_id in list(self.index.tiers):
                self.policies.forget(tier_id)
            adopt(tx.session)  # last: a reread that fails part way is made again at the next round
        self.writer.run_alone(job)
        log.info("index of %d blocks read again in %.1f s", self.index.num_blocks, time.perf_counter() - t0)

    def follow_from(self, session: Session, now: float) -> int:
        """A follower's index, namespaces and recent hand-offs, from SQL; returns the blocks indexed."""
        self.namespaces.load(session)
        self.index.rebuild(session)
        self.handoffs.learn_recent(session, now)
        return self.index.num_blocks

    def apply(self, session: Session, changes: Changes) -> None:
        """A follower applies a batch of the leader's changes."""
        if changes.topology:
            self.index.reload_topology(session)
        if changes.blocks:
            self.index.reload(session, changes.blocks)
        if changes.namespaces:
            self.namespaces.load(session)
        if changes.handoffs:  # after the blocks: a waiter that hears of a hand-off finds its blocks
            self.handoffs.learned(repo.handoff_rows(session, changes.handoffs))

    def write(self, job: Callable[[Tx], object]) -> object:
        return self.writer.run(job)

    def recover(self) -> int:
        """Reservations open when the directory stopped are rolled back (their writers got no answer
        they could trust), moves that were in flight are undone (their destinations stay reserved
        until their worker says it stopped writing them, or until the move's deadline), and every
        live worker gets a full heartbeat timeout to check in (the directory's own downtime is not
        their silence)."""
        def job(tx: Tx) -> tuple[int, int]:
            now = self._clock()
            rows = [row for row in repo.replicas_in_state(tx.session, WRITING)
                    if not (row[0].token.startswith("move-") and (row[0].expires_at or 0) > now)]
            self._reclaim.drop(tx, rows)
            moving = repo.replicas_in_state(tx.session, MOVING)
            for replica, _, _ in moving:
                replica.state = READY
            self.membership.excuse(tx, now)
            return len(rows), len(moving)
        rolled_back, moving = self.writer.run(job)
        if rolled_back or moving:
            log.info("start-up: rolled back %d open reservations, %d moves in flight", rolled_back, moving)
        return rolled_back

    # ---- the hot calls, checked -------------------------------------------------------------------

    async def prepare_store_async(self, req, tenants: frozenset[str] | None = None) -> dict:
        check_blocks(self.namespaces.get(req.namespace_id, tenants), req.blocks)
        return await self.store.prepare_async(req)

    async def complete_store_async(self, req):
        if self.settings.verify_writes:
            req = await asyncio.to_thread(verified, req, self.store.reservations, self.index, self.calls,
                                          self.metrics)
        return await self.store.complete_async(req)

    def renew(self, token: str) -> specs.Renewed:
        return self.store.renew(token)

    def abort_store(self, token: str) -> int:
        return self.store.abort(token)

    def lookup(self, namespace_id: str, hashes: list[str], locations: bool = False,
               tenants: frozenset[str] | None = None) -> dict:
        self.namespaces.get(namespace_id, tenants)
        return self.loads.lookup(namespace_id, hashes, locations)

    def lookup_tokens(self, namespace_id: str, token_ids: list[int], tenants: frozenset[str] | None = None,
                      hash_seed: str | None = None) -> specs.TokenLookupResult:
        namespace = self.namespaces.get(namespace_id, tenants)
        hashes = prefix_hashes(namespace, token_ids, hash_seed)
        hit = self.loads.lookup(namespace_id, hashes, locations=False)["num_hit_blocks"]
        return specs.TokenLookupResult(hit_tokens=hit * namespace.block_tokens, num_hit_blocks=hit,
                                       block_tokens=namespace.block_tokens)

    def inspect(self, req: InspectRequest, tenants: frozenset[str] | None = None) -> InspectResult:
        namespace = self.namespaces.get(req.namespace_id, tenants)
        hashes = req.hashes if req.hashes is not None else \
            prefix_hashes(namespace, req.token_ids, req.hash_seed, max_blocks=MAX_INSPECTED)
        return inspection.inspect(self.sessions, req.namespace_id, namespace.block_tokens, hashes, self.index.ids)

    def complete_loads(self, req) -> specs.LoadCompleted:
        return self.loads.complete(req)

    @property
    def ready(self) -> bool:
        """Whether the lookup index is built, and at a start the page credit too (lookups and /readyz
        wait for it: a save would wait for the writer until then)."""
        return self.index.ready and not self._starting

    @property
    def indexed_blocks(self) -> int:
        return self.index.num_blocks

    def prepare_loads(self, namespace_id: str, chains: list[list[str]], reader: str,
                      tenants: frozenset[str] | None = None, push_owner: str | None = None) -> dict:
        """`push_owner`: the answer also grants pushes of its DRAM hits (`kvstore.core.push`) to the
        reader, an engine calling with the credential of this id."""
        namespace = self.namespaces.get(namespace_id, tenants)
        pushes = (namespace.tenant, push_owner) if push_owner is not None and reader else None
        return self.loads.prepare(namespace_id, chains, reader, pushes)

    def commit_handoff(self, body: HandoffCommit, tenants: frozenset[str] | None = None) -> HandoffState:
        self.namespaces.get(body.namespace_id, tenants)
        return self.handoffs.commit(body)

    async def wait_handoff(self, body: HandoffWait, tenants: frozenset[str] | None = None,
                           caller: str = "") -> HandoffState:
        self.namespaces.get(body.namespace_id, tenants)
        return await self.handoffs.wait(body, caller)

    def flush(self) -> None:
        """At shut-down, while still the leader: every access statistic not yet in SQL goes there
        (the eviction order a restart rebuilds depends on them)."""
        if self.leading:
            try:
                self.reaper.flush()  # a reaper tick still running finishes first
            except Exception:  # noqa: BLE001 (a database gone at shut-down costs only recency)
                log.exception("the last access statistics were not written")

    def close(self) -> None:
        self.writer.close()
        self.calls.close()
        self.policies.close()

