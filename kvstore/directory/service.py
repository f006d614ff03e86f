"""The directory: its parts wired together, namespaces, the reaper, operator calls.

Calls, in the order a block lives through them:
    start()                                             # recover, rebuild index and page pools (readyz)
    register_namespace (workers: membership.register_worker / heartbeat)
    store.prepare -> store.complete | store.abort       (WRITING -> READY, or rolled back)
    loads.lookup                                        (the in-memory index: no lock, no SQL)
    loads.prepare -> loads.complete                     (promotes to memory if needed; pins under a lease)
    handoffs.commit / handoffs.wait                     (a prefill engine's saves, awaited by a decode engine)
    reap()                                              (expired leases and reservations, dead workers,
                                                         moves whose answer was lost, access statistics,
                                                         drains, demotion, write-through,
                                                         copies to other workers for replicated namespaces)

Every change to SQL is a job on the one writer (`writer.py`, group commit);
worker calls are made outside jobs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.inspection import MAX_INSPECTED, InspectRequest, InspectResult
from kvstore.core.keys import Namespace
from kvstore.core.namespaces import NamespaceInfo
from kvstore.core.tiers import MEMORY
from kvstore.directory import repository as repo
from kvstore.directory import inspection, wire
from kvstore.directory.handoffs import Handoffs
from kvstore.directory.index import Index
from kvstore.directory.inspection import prefix_hashes
from kvstore.directory.load import Loads
from kvstore.directory.membership import Membership
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.models import NamespaceRow
from kvstore.directory.models.replica import DELETING, MOVING, READY, WRITING
from kvstore.directory.movement import Movement
from kvstore.directory.moves import Moves
from kvstore.directory.orphans import Orphans
from kvstore.directory.policy import TierPolicies
from kvstore.directory.pools import PagePools
from kvstore.directory.reclaim import Reclaim
from kvstore.directory.reservations import Reservations
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.spread import Spread
from kvstore.directory.store import Store
from kvstore.directory.workercalls import WorkerCalls
from kvstore.directory.writer import Tx, Writer

log = logging.getLogger(__name__)


class DirectoryService:
    def __init__(self, sessions: sessionmaker[Session], settings: DirectorySettings,
                 metrics: DirectoryMetrics, clock: Callable[[], float] = time.time) -> None:
        self._sessions = self.sessions = sessions
        self.settings = settings
        self.leading = True  # among several replicas, whether this one writes (replicas.py says)
        self.metrics = metrics
        self._clock = clock
        self.policies = TierPolicies(settings.tier_eviction(), settings.tier_admission())
        self.index = Index(on_change=self.policies.changed)
        self.pools = PagePools()
        self.writer = Writer(sessions, self._follow_commit)
        write = self.writer.run
        self.calls = WorkerCalls(move_timeout_s=settings.move_timeout_s, ca_file=settings.ca_file)
        reclaim = Reclaim(self.calls, self.pools)
        self.reservations = Reservations()
        moves = Moves(write, self.calls, reclaim, self.pools, metrics, clock)
        self.orphans = Orphans(write, moves, self.calls, reclaim)
        self.movement = Movement(write, moves, reclaim, self.pools, self.policies, self.reservations.reserved_bytes)
        self.spread = Spread(write, moves, reclaim, self.pools)
        self.membership = Membership(write, self.calls, reclaim, self.pools, settings, clock)
        self.store = Store(self.writer, self.index, self.pools, self.reservations, self.policies, metrics, settings,
                           self.movement.make_room, clock)
        self.loads = Loads(write, self.index, self.movement.promote, reclaim, self.policies, metrics, settings, clock,
                           self.calls.verify)
        self.handoffs = Handoffs(write, sessions, self.index.count, metrics, lambda: self.leading, clock)
        self._reclaim = reclaim
        self._namespaces: dict[str, Namespace] = {}
        self._reaping = threading.Lock()

    def _follow_commit(self, touched: set[int], topology: bool, committed: list) -> None:
        """After each group commit (writer thread): the index adds the replicas the group committed,
        then reads back every other block the group touched (that read is the final word)."""
        if committed:
            self.index.add(committed)
        if touched or topology:
            with self._sessions() as session:
                if topology:
                    self.index.reload_topology(session)
                if touched:
                    self.index.reload(session, touched)

    # ---- start -------------------------------------------------------------------------------

    def start(self, rebuild_index: bool = True) -> None:
        """Recover from the stop, then build the index, the page pools and the namespaces from SQL
        (a follower that becomes the leader has its index already: it followed every commit)."""
        self.recover()
        t0 = time.perf_counter()

        def build(tx: Tx) -> None:  # a job: nothing commits while the index is read from SQL
            self.load_namespaces(tx.session)
            for worker in repo.workers(tx.session):
                if worker.state != "dead":  # a dead row may name the endpoint a live worker has now
                    self.calls.authorize(worker.control_url, worker.control_secret)
            if rebuild_index:
                self.index.rebuild(tx.session)
            else:
                self.index.reload_topology(tx.session)
            self.pools.rebuild(tx.session, self.index.tiers, self.index.workers)
        self.writer.run(build)
        log.info("index of %d blocks built in %.1f s", self.index.num_blocks, time.perf_counter() - t0)

    def load_namespaces(self, session: Session) -> None:
        self._namespaces.update({row.id: Namespace.from_dict(row.spec) for row in session.query(NamespaceRow)})

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
            for worker in repo.workers(tx.session):
                if worker.state != "dead":
                    worker.heartbeat_at = max(worker.heartbeat_at, now)
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
                    tx.session.add(NamespaceRow(id=namespace.namespace_id, spec=namespace.to_dict(),
                                                created_at=self._clock()))
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
        with self._sessions() as session:
            usage = repo.namespace_usage(session)
            rows = session.query(NamespaceRow).order_by(NamespaceRow.created_at).all()
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

    def prepare_store(self, req: specs.PrepareStore) -> dict:
        check_blocks(self.namespace(req.namespace_id), req.blocks)
        return self.store.prepare(req)

    async def prepare_store_async(self, req, tenants: frozenset[str] | None = None) -> dict:
        check_blocks(self.namespace(req.namespace_id, tenants), req.blocks)
        return await self.store.prepare_async(req)

    async def complete_store_async(self, req):
        if self.settings.verify_writes:
            req = await asyncio.to_thread(self._verified, req)
        return await self.store.complete_async(req)

    def _verified(self, req):
        """The writer's report, with every block its worker does not find matching the reported
        checksum marked failed (so it is not committed). Asked before the commit, outside every job."""
        r = self.store.reservations.get(req.token)
        worker = self.index.workers.get(r.worker_id) if r else None
        tier = self.index.tiers.get(r.tier_id) if r else None
        claimed = {b.hash: b.checksum for b in req.blocks if b.ok and b.checksum}
        written = [b for b in r.blocks if b.hash in claimed] if worker and tier else []
        if not written:
            return req  # nothing to check; completing says what is wrong with the token
        replicas = [(tier.kind, b.runs, b.nbytes, claimed[b.hash]) for b in written]
        matches = self.calls.verify(worker.control_url, replicas)
        bad = {b.hash for b, match in zip(written, matches) if match is not True}
        if not bad:
            return req
        log.warning("%d of %d blocks written under %s do not match their writer's checksum; not committed",
                    len(bad), len(written), req.token[:8])
        self.metrics.checksum_failures.inc(len(bad))
        return wire.CompleteStore(token=req.token, blocks=[
            wire.BlockWritten(hash=b.hash, ok=b.ok and b.hash not in bad, checksum=b.checksum) for b in req.blocks])

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
        return inspection.inspect(self._sessions, req.namespace_id, namespace.block_tokens, hashes)

    def prepare_loads(self, namespace_id: str, chains: list[list[str]], reader: str,
                      tenants: frozenset[str] | None = None) -> dict:
        self.namespace(namespace_id, tenants)
        return self.loads.prepare(namespace_id, chains, reader)

    # ---- background -----------------------------------------------------------------------

    def reap(self) -> dict[str, int]:
        """Expire leases and reservations, declare silent workers dead, free deleted replicas, flush
        access statistics, then move blocks (demotion, drains, write-through)."""
        with self._reaping:  # one round at a time, whoever calls
            return self._reap()

    def _reap(self) -> dict[str, int]:
        def job(tx: Tx) -> tuple[int, int, int, list[int]]:
            now = self._clock()
            leases = repo.delete_expired_leases(tx.session, now)
            tokens = repo.expired_reservations(tx.session, now)  # moves' destinations
            for token in tokens:
                rows = repo.replicas_with_token(tx.session, token, WRITING)
                self._reclaim.drop(tx, [(r, t, w) for r, _, t, w in rows])
            dead = self.membership.declare_dead(tx, now)
            draining = self.membership.finish_drains(tx)
            self.handoffs.expire(tx, now)
            if leases or tokens or dead:
                self._reclaim.collect_deleting(tx)
            return leases, len(tokens) + self.store.expire(tx, now), dead, draining
        leases, tokens, dead, draining = self.writer.run(job)
        if dead:
            self.metrics.declared_dead.inc(dead)
        if leases or tokens or dead:
            log.info("reaper: %d expired pins, %d expired reservations, %d dead workers", leases, tokens, dead)
        settled = self.orphans.settle()  # moves whose answer was lost, whose workers have stopped them
        self.loads.flush_accesses()
        for worker_id in self.membership.ungranted():
            self.membership.grant(worker_id)
        drained = sum(self.spread.drain(w) for w in draining)  # onto other workers first
        drained += self.movement.drain(draining) if draining else 0  # what found no room there: a tier down
        demoted = self.movement.demote()
        copied = self.movement.write_through()
        replicated = self.spread.replicate()
        return {"leases": leases, "reservations": tokens + settled, "dead_workers": dead, "drained": drained,
                "demoted": demoted, "written_through": copied, "replicated": replicated}

    # ---- operators ------------------------------------------------------------------------

    def evict_tier(self, req: specs.EvictRequest) -> specs.Evicted:
        targets = self.writer.run(lambda tx: [(t.id, w.id) for t, w in repo.active_tiers(tx.session, req.tier)
                                              if req.worker is None or w.name == req.worker])
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
        with self._sessions() as session:
            return [specs.TierUsage(worker=w.name, kind=t.kind, capacity_bytes=t.capacity_bytes,
                                    used_bytes=t.used_bytes + self.reservations.reserved_bytes(t.id), num_blocks=n,
                                    page_bytes=t.page_bytes,
                                    high_watermark=t.high_watermark, low_watermark=t.low_watermark,
                                    credit_free_bytes=self.pools.free_bytes(t.id, w.epoch)
                                    if t.kind in MEMORY and self.leading else None)
                    for t, w, n in repo.tier_usage(session)]

    def ping_database(self) -> None:
        """Raises when the database does not answer a trivial query."""
        with self._sessions() as session:
            session.execute(text("SELECT 1"))

    def stats(self) -> specs.Stats:
        with self._sessions() as session:
            counts = repo.counts(session)  # its reservations are the moves' destinations
            counts["reservations"] += self.reservations.blocks
            return specs.Stats(**counts, replicas_by_tier=repo.replicas_by_tier(session),
                               indexed_blocks=self.index.num_blocks, leader=self.leading,
                               commit_groups=self.writer.groups, committed_jobs=self.writer.jobs)

    def flush(self) -> None:
        """At shut-down, while still the leader: every access statistic not yet in SQL goes there
        (the eviction order a restart rebuilds depends on them)."""
        if self.leading:
            try:
                with self._reaping:  # a reaper tick still running finishes first
                    self.loads.flush_accesses(rows=None)
            except Exception:  # noqa: BLE001 (a database gone at shut-down costs only recency)
                log.exception("the last access statistics were not written")

    def close(self) -> None:
        self.writer.close()
        self.calls.close()


def _foreign(namespace: Namespace, tenants: frozenset[str] | None) -> bool:
    """Whether the namespace belongs to none of `tenants` (None: the caller may use every tenant's)."""
    return tenants is not None and namespace.tenant not in tenants


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
