"""The directory: its parts wired together, and the calls routes make of it.

Calls, in the order a block lives through them:
    start()                                             # recover, rebuild index and page pools (readyz)
    register_namespace (workers: register_worker / heartbeat)
    prepare_store_async -> complete_store_async | abort_store   (WRITING -> READY, or rolled back)
    lookup                                              (the in-memory index: no lock, no SQL)
    prepare_loads -> loads.complete                     (promotes to memory if needed; pins under a lease)
    commit_handoff / wait_handoff                       (a prefill engine's saves, awaited by a decode engine)
    reaper.reap()                                       (expired leases, reservations and workers; moves)

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
from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import HandoffCommit, HandoffState, HandoffWait
from kvstore.core.inspection import MAX_INSPECTED, InspectRequest, InspectResult
from kvstore.core.keys import Namespace
from kvstore.core.namespaces import NamespaceInfo
from kvstore.core.tiers import MEMORY
from kvstore.directory.db import repository as repo
from kvstore.directory.db.changelog import ChangeLog, Changes, term
from kvstore.directory.db.index import Index
from kvstore.directory.db.models.replica import DELETING, MOVING, READY, WRITING
from kvstore.directory.db.writer import Tx, Writer
from kvstore.directory.handoffs import Handoffs
from kvstore.directory.loads import inspection
from kvstore.directory.loads.inspection import prefix_hashes
from kvstore.directory.loads.loads import Loads
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.moves.move import Moves
from kvstore.directory.moves.orphans import Orphans
from kvstore.directory.moves.spread import Spread
from kvstore.directory.moves.tiers import Movement
from kvstore.directory.reaper import Reaper
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
    def __init__(self, sessions: sessionmaker[Session], settings: DirectorySettings,
                 metrics: DirectoryMetrics, changelog: ChangeLog | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.settings = settings
        self.changelog = changelog or ChangeLog()  # whether this replica leads, and its commits' log
        self.metrics = metrics
        self._clock = clock
        self.policies = TierPolicies(settings.tier_eviction(), settings.tier_admission())
        self.index = Index(on_change=self.policies.changed)
        self.pools = PagePools()
        self.writer = Writer(sessions, lambda *commit: self.index.follow_commit(sessions, *commit),
                             self.changelog.before_commit, relax=self.changelog.relaxed)
        write = self.writer.run
        self.calls = WorkerCalls(move_timeout_s=settings.move_timeout_s, ca_file=settings.ca_file)
        reclaim = Reclaim(self.calls, self.pools)
        self.reservations = Reservations()
        moves = Moves(write, self.calls, reclaim, self.pools, metrics, self.index, clock, read=self.writer.read)
        orphans = Orphans(write, moves, self.calls, reclaim)
        self.movement = Movement(write, moves, reclaim, self.pools, self.policies, self.reservations.reserved_bytes,
                                 promote_timeout_s=min(settings.move_timeout_s, settings.lease_ttl_s),
                                 read=self.writer.read)
        spread = Spread(write, moves, reclaim, self.pools)
        self.membership = Membership(write, self.calls, reclaim, self.pools, settings, clock, self.index.ids)
        self.store = Store(self.writer, self.index, self.pools, self.reservations, self.policies, metrics, settings,
                           self.movement.make_room, clock)
        self.loads = Loads(write, self.index, self.movement.promote, reclaim, self.policies, metrics, settings, clock,
                           self.calls.verify)
        self.handoffs = Handoffs(write, sessions, self.index.count, metrics, lambda: self.leading, clock)
        self.reaper = Reaper(self.writer, reclaim, self.membership, self.handoffs, self.store, self.loads, orphans,
                             spread, self.movement, metrics, clock)
        self._reclaim = reclaim
        self._namespaces: dict[str, Namespace] = {}

    @property
    def leading(self) -> bool:
        """Among several directory replicas, whether this one writes."""
        return self.changelog.leading

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
        self.writer.run(lambda tx: self._build(tx, rebuild_index))  # nothing commits while SQL is read
        log.info("index of %d blocks built in %.1f s", self.index.num_blocks, time.perf_counter() - t0)

    def _build(self, tx: Tx, rebuild_index: bool) -> None:
        self.load_namespaces(tx.session)
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

    def load_namespaces(self, session: Session) -> None:
        self._namespaces.update({row.id: Namespace.from_dict(row.spec) for row in repo.namespace_rows(session)})

    def follow_from(self, session: Session, now: float) -> int:
        """A follower's index, namespaces and recent hand-offs, from SQL; returns the blocks indexed."""
        self.load_namespaces(session)
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
            self.load_namespaces(session)
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

    # ---- namespaces -----------------------------------------------------------------------------

    def register_namespace(self, data: dict, tenants: frozenset[str] | None = None) -> str:
        """`tenants`: those of the caller (None: any); a namespace of another tenant is refused."""
        namespace = Namespace.from_dict(data)
        if _foreign(namespace, tenants):
            raise KVStoreError("forbidden", f"this token may register namespaces of tenants {sorted(tenants)} "
                               f"only, not {namespace.tenant!r}", tenant=namespace.tenant)
        if namespace.namespace_id not in self._namespaces:
            def job(tx: Tx) -> None:
                if repo.namespace(tx.session, namespace.namespace_id) is None:
                    repo.add_namespace(tx.session, namespace.namespace_id, namespace.to_dict(), self._clock())
            self.writer.run(job)
            self._namespaces[namespace.namespace_id] = namespace
        return namespace.namespace_id

    def namespace(self, namespace_id: str, tenants: frozenset[str] | None = None) -> Namespace:
        """The namespace, if it exists and belongs to one of `tenants` (None: any). Another tenant's
        namespace gets the same answer as one that does not exist."""
        namespace = self._namespaces.get(namespace_id)
        if namespace is None or _foreign(namespace, tenants):
            raise KVStoreError("not_found", "unknown namespace; register it first (POST /v1/namespaces)",
                               namespace_id=namespace_id)
        return namespace

    def namespaces(self, tenants: frozenset[str] | None = None) -> list[NamespaceInfo]:
        """Every namespace the caller's tenants hold (None: all), with its replicas and bytes per tier."""
        with self.sessions() as session:
            usage = repo.namespace_usage(session)
            rows = repo.namespace_rows(session)
        out = []
        for row in rows:
            ns = Namespace.from_dict(row.spec)
            if _foreign(ns, tenants):
                continue
            held = usage.get(row.id, {})
            out.append(NamespaceInfo(namespace_id=row.id, tenant=ns.tenant, model_id=ns.model_id,
                                     model_revision=ns.model_revision, hash_scheme=ns.hash_scheme,
                                     block_tokens=ns.block_tokens, block_nbytes=ns.block_nbytes,
                                     write_through=bool(row.write_through), replicas=row.replicas or 1,
                                     blocks={k: n for k, (n, _) in held.items()},
                                     bytes={k: b for k, (_, b) in held.items()}))
        return out

    def set_policy(self, namespace_id: str, policy: specs.NamespacePolicy) -> specs.NamespacePolicy:
        """Changes the fields the body names (the others keep their values); returns the whole policy."""
        self.namespace(namespace_id)

        def job(tx: Tx) -> specs.NamespacePolicy:
            row = repo.namespace(tx.session, namespace_id)
            for name in policy.model_fields_set:
                setattr(row, name, getattr(policy, name))
            return specs.NamespacePolicy(write_through=bool(row.write_through), replicas=row.replicas or 1)
        return self.writer.run(job)

    # ---- the hot calls, checked -------------------------------------------------------------------

    async def prepare_store_async(self, req, tenants: frozenset[str] | None = None) -> dict:
        check_blocks(self.namespace(req.namespace_id, tenants), req.blocks)
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
        self.namespace(namespace_id, tenants)
        return self.loads.lookup(namespace_id, hashes, locations)

    def lookup_tokens(self, namespace_id: str, token_ids: list[int], tenants: frozenset[str] | None = None,
                      hash_seed: str | None = None) -> specs.TokenLookupResult:
        namespace = self.namespace(namespace_id, tenants)
        hashes = prefix_hashes(namespace, token_ids, hash_seed)
        hit = self.loads.lookup(namespace_id, hashes, locations=False)["num_hit_blocks"]
        return specs.TokenLookupResult(hit_tokens=hit * namespace.block_tokens, num_hit_blocks=hit,
                                       block_tokens=namespace.block_tokens)

    def inspect(self, req: InspectRequest, tenants: frozenset[str] | None = None) -> InspectResult:
        namespace = self.namespace(req.namespace_id, tenants)
        hashes = req.hashes if req.hashes is not None else \
            prefix_hashes(namespace, req.token_ids, req.hash_seed, max_blocks=MAX_INSPECTED)
        return inspection.inspect(self.sessions, req.namespace_id, namespace.block_tokens, hashes, self.index.ids)

    def complete_loads(self, req) -> specs.LoadCompleted:
        return self.loads.complete(req)

    @property
    def ready(self) -> bool:
        """Whether the lookup index is built (lookups and /readyz wait for it)."""
        return self.index.ready

    @property
    def indexed_blocks(self) -> int:
        return self.index.num_blocks

    def prepare_loads(self, namespace_id: str, chains: list[list[str]], reader: str,
                      tenants: frozenset[str] | None = None) -> dict:
        self.namespace(namespace_id, tenants)
        return self.loads.prepare(namespace_id, chains, reader)

    def commit_handoff(self, body: HandoffCommit, tenants: frozenset[str] | None = None) -> HandoffState:
        self.namespace(body.namespace_id, tenants)
        return self.handoffs.commit(body)

    async def wait_handoff(self, body: HandoffWait, tenants: frozenset[str] | None = None,
                           caller: str = "") -> HandoffState:
        self.namespace(body.namespace_id, tenants)
        return await self.handoffs.wait(body, caller)

    # ---- operators ------------------------------------------------------------------------

    def evict_tier(self, req: specs.EvictRequest) -> specs.Evicted:
        workers = self.index.workers  # the topology as of the last commit: no job to read it
        targets = sorted((t.id, w.id) for t in self.index.tiers.values() for w in [workers.get(t.worker_id)]
                         if t.kind == req.tier and w and w.state == "active" and req.worker in (None, w.name))
        if req.worker is not None and not targets:
            raise KVStoreError("not_found", f"no active worker {req.worker!r} with a {req.tier} tier",
                               worker=req.worker, tier=req.tier)
        total = {"replicas": 0, "bytes": 0, "demoted": 0, "dropped": 0}
        for tier_id, worker_id in targets:
            left = None if req.bytes is None else req.bytes - total["bytes"]
            if (left is not None and left <= 0) or req.limit <= total["replicas"]:
                break
            outcome = self.movement.evict(tier_id, worker_id, left, req.namespace_id,
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
        evicted = self.writer.run(job)
        if not dry_run:
            log.info("evicted %d replicas%s", evicted.replicas, f" of namespace {namespace_id}" if namespace_id else "")
        return evicted

    def tiers(self) -> list[specs.TierUsage]:
        with self.sessions() as session:
            return [specs.TierUsage(worker=w.name, kind=t.kind, capacity_bytes=t.capacity_bytes,
                                    used_bytes=t.used_bytes + self.reservations.reserved_bytes(t.id), num_blocks=n,
                                    kv_bytes=kv, block_bytes=held, page_bytes=t.page_bytes,
                                    high_watermark=t.high_watermark, low_watermark=t.low_watermark,
                                    credit_free_bytes=self.pools.free_bytes(t.id, w.epoch)
                                    if t.kind in MEMORY and self.leading else None)
                    for t, w, n, kv, held in repo.tier_usage(session)]

    def metrics_text(self) -> bytes:
        """Prometheus' text: the counters, the stats, and (on the leader) tiers and workers."""
        return self.metrics.render(self.stats(), self.tiers() if self.leading else [], self.membership.workers())

    def ping_database(self) -> None:
        """Raises when the database does not answer a trivial query."""
        with self.sessions() as session:
            repo.ping(session)

    def stats(self) -> specs.Stats:
        with self.sessions() as session:
            counts = repo.counts(session)  # its reservations are the moves' destinations
            counts["reservations"] += self.reservations.blocks
            return specs.Stats(**counts, replicas_by_tier=repo.replicas_by_tier(session),
                               indexed_blocks=self.index.num_blocks, leader=self.leading, term=term(session) or 0,
                               follower_lag_s=round(self.changelog.lag_s, 3),
                               commit_groups=self.writer.groups, committed_jobs=self.writer.jobs)

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


def _foreign(namespace: Namespace, tenants: frozenset[str] | None) -> bool:
    """Whether the namespace belongs to none of `tenants` (None: the caller may use every tenant's)."""
    return tenants is not None and namespace.tenant not in tenants
