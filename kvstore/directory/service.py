"""The directory's rules: two-phase store, lookup, leased loads, reaping, operator eviction.

Calls, in the order a block lives through them:
    register_namespace (workers: membership.register_worker / heartbeat)
    prepare_store -> complete_store | abort_store      (WRITING -> READY, or rolled back)
    lookup                                              (pure read + access statistics)
    prepare_load -> complete_load                       (promotes to DRAM if needed; pins under a lease)
    reap()                                              (expired leases and reservations, dead workers,
                                                         demotion, write-through)

Each call is one transaction. Worker page frees are side effects outside the
database, so they run only after the transaction commits; pages allocated
for a transaction that then fails are given back.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session, sessionmaker

from kvstore.client.worker import WorkerControlClient
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace, block_hashes
from kvstore.directory import repository as repo
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.membership import Membership
from kvstore.directory.movement import TIER_ORDER, Movement
from kvstore.directory.policy import TierPolicies, block_key
from kvstore.directory.models import Block, NamespaceRow, Replica, Tier, Worker
from kvstore.directory.models.replica import DELETING, MOVING, READY, WRITING
from kvstore.directory.settings import DirectorySettings
from kvstore.policies import Admit, Throttled

log = logging.getLogger(__name__)
TIER_PREFERENCE = {kind: rank for rank, kind in enumerate(TIER_ORDER)}  # the best replica is the fastest
READABLE_BY_ENGINES = ("hbm", "dram")  # what a connector reads one-sidedly over UCX
PLACEMENT_TIERS = ("hbm", "dram")  # new blocks go to the fastest memory tier the workers have


class Tx:
    """A session plus the worker calls to make once it commits (or if it fails)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.after_commit: list[Callable[[], None]] = []
        self.on_rollback: list[Callable[[], None]] = []


class DirectoryService:
    def __init__(self, sessions: sessionmaker[Session], settings: DirectorySettings,
                 metrics: DirectoryMetrics, clock: Callable[[], float] = time.time) -> None:
        self._sessions = sessions
        self.settings = settings
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.RLock()  # one writer at a time within this process
        self._worker_clients: dict[str, WorkerControlClient] = {}
        self.policies = TierPolicies(settings.tier_eviction(), settings.tier_admission())
        self.movement = Movement(self)
        self.membership = Membership(self)

    @contextmanager
    def _tx(self) -> Iterator[Tx]:
        with self._lock, self._sessions() as session:
            tx = Tx(session)
            try:
                yield tx
                session.commit()
            except BaseException:
                session.rollback()
                _run_all(tx.on_rollback)
                raise
        _run_all(tx.after_commit)

    # ---- namespaces and workers -------------------------------------------------------

    def register_namespace(self, data: dict) -> str:
        namespace = Namespace.from_dict(data)
        with self._tx() as tx:
            if repo.namespace(tx.session, namespace.namespace_id) is None:
                tx.session.add(NamespaceRow(id=namespace.namespace_id, spec=namespace.to_dict(),
                                            created_at=self._clock()))
        return namespace.namespace_id

    def set_policy(self, namespace_id: str, policy: specs.NamespacePolicy) -> specs.NamespacePolicy:
        with self._tx() as tx:
            row = self._namespace(tx, namespace_id)
            row.write_through = policy.write_through
        return policy

    # ---- store --------------------------------------------------------------------------

    def prepare_store(self, req: specs.PrepareStore) -> specs.StorePrepared:
        self._make_room(sum(b.nbytes for b in req.blocks))
        now = self._clock()
        with self._tx() as tx:
            namespace = self._namespace(tx, req.namespace_id)
            _check_sizes(namespace, req.blocks)
            existing = repo.blocks_by_hash(tx.session, req.namespace_id, [b.hash for b in req.blocks])
            states = _replica_states(tx.session, existing)
            decisions: dict[str, specs.StoreDecision] = {}
            wanted = []
            for block in req.blocks:
                state = states.get(block.hash, set())
                if READY in state:
                    decisions[block.hash] = specs.StoreDecision(hash=block.hash, status="exists")
                elif WRITING in state:
                    decisions[block.hash] = specs.StoreDecision(hash=block.hash, status="in_progress")
                else:
                    wanted.append(block)
            token = secrets.token_hex(16)
            expires_at = now + self.settings.reservation_ttl_s
            admitted = self._place(tx, req.namespace_id, wanted, existing, token, expires_at, now, decisions)
            self.metrics.count_store_decisions(decisions.values())
            ordered = [decisions[b.hash] for b in req.blocks]
        return specs.StorePrepared(token=token if admitted else None,
                                   expires_at=expires_at if admitted else None, blocks=ordered)

    def _make_room(self, nbytes: int) -> None:
        """If the tier placement would pick cannot take `nbytes`, demote first (outside the store's
        transaction). Best effort: what still does not fit is rejected with no_space."""
        with self._tx() as tx:
            choice = _placement(tx.session)
            ids = (choice[0].id, choice[1].id) if choice else None
        if ids:
            try:
                self.movement.make_room(*ids, nbytes, protected=set())
            except KVStoreError as exc:
                log.warning("could not make room: %s", exc)

    def _place(self, tx: Tx, namespace_id: str, wanted: list[specs.BlockToStore], existing: dict[str, Block],
               token: str, expires_at: float, now: float, decisions: dict) -> int:
        """Reserve pages for `wanted` on one worker's DRAM tier; fills `decisions`."""
        if not wanted:
            return 0
        choice = _placement(tx.session)
        if choice is None:
            for block in wanted:
                decisions[block.hash] = specs.StoreDecision(hash=block.hash, status="rejected", reason="no_worker")
            return 0
        tier, worker = choice
        wanted = self._admitted(tier, namespace_id, wanted, decisions)
        if not wanted:
            return 0
        client = self._worker_client(worker.control_url)
        result = client.allocate(specs.AllocRequest(token=token, kind=tier.kind, sizes=[b.nbytes for b in wanted]))
        if len(result.runs) != len(wanted):
            raise KVStoreError("internal", "worker answered a different number of allocations",
                               worker=worker.name)
        allocated = [(token, runs) for runs in result.runs if runs is not None]
        tx.on_rollback.append(self._free_later(worker.control_url, allocated))  # if this transaction fails
        admitted: list[tuple[specs.BlockToStore, list[specs.PageRun]]] = []
        rejected: set[str] = set()
        for block, runs in zip(wanted, result.runs):
            if runs is None or block.parent in rejected:  # a suffix without its prefix is useless
                if runs is not None:
                    tx.after_commit.append(self._free_later(worker.control_url, [(token, runs)]))
                rejected.add(block.hash)
                reason = "no_space" if runs is None else "parent_rejected"
                decisions[block.hash] = specs.StoreDecision(hash=block.hash, status="rejected", reason=reason)
            else:
                admitted.append((block, runs))
        block_ids = self._new_blocks(tx, namespace_id, [b for b, _ in admitted], existing, now)
        replicas = []
        for block, runs in admitted:
            reserved = sum(r.count for r in runs) * tier.page_bytes
            replicas.append(dict(block_id=block_ids[block.hash], tier_id=tier.id, epoch=worker.epoch,
                                 state=WRITING, token=token, pages=[[r.first, r.count] for r in runs],
                                 reserved_bytes=reserved, expires_at=expires_at, created_at=now))
            tier.used_bytes += reserved
            decisions[block.hash] = specs.StoreDecision.model_construct(  # built from trusted values: skip validation
                hash=block.hash, status="admitted", location=_location(worker, tier, runs, block.nbytes))
        repo.insert_replicas(tx.session, replicas)
        return len(admitted)

    def _admitted(self, tier: Tier, namespace_id: str, wanted: list[specs.BlockToStore],
                  decisions: dict) -> list[specs.BlockToStore]:
        """The blocks the tier's admission lets in; the others (and their suffixes) are rejected."""
        admitted, rejected = [], set()
        for block in wanted:
            decision = self.policies.admit(tier, block_key(namespace_id, block.hash), block.nbytes)
            if block.parent in rejected or not isinstance(decision, Admit):
                reason = ("parent_rejected" if block.parent in rejected else
                          "throttled" if isinstance(decision, Throttled) else "not_admitted")
                rejected.add(block.hash)
                decisions[block.hash] = specs.StoreDecision(
                    hash=block.hash, status="rejected", reason=reason,
                    retry_after_s=decision.retry_after_s if isinstance(decision, Throttled) else None)
            else:
                admitted.append(block)
        return admitted

    def _new_blocks(self, tx: Tx, namespace_id: str, blocks: list[specs.BlockToStore],
                    existing: dict[str, Block], now: float) -> dict[str, int]:
        """Ids of `blocks`, inserting the ones the directory has not seen. Depth follows the parent chain."""
        ids = {h: b.id for h, b in existing.items()}
        depths = {h: b.depth for h, b in existing.items()}
        outside = {b.parent for b in blocks if b.parent and b.parent not in depths} - {b.hash for b in blocks}
        if outside:  # a chain saved in several calls (chunked prefill): continue from the stored parent
            depths.update({h: b.depth for h, b in repo.blocks_by_hash(tx.session, namespace_id, sorted(outside)).items()})
        rows = []
        for block in blocks:
            if block.hash in ids:
                continue
            depths[block.hash] = depths[block.parent] + 1 if block.parent in depths else 0
            rows.append(dict(namespace_id=namespace_id, hash=block.hash, parent=block.parent,
                             depth=depths[block.hash], nbytes=block.nbytes, created_at=now, last_access=now,
                             hit_count=0))
        ids.update(repo.insert_blocks(tx.session, rows))
        return ids

    def complete_store(self, req: specs.CompleteStore) -> specs.StoreCompleted:
        now = self._clock()
        reports = {b.hash: b for b in req.blocks}
        with self._tx() as tx:
            rows = repo.writing_rows(tx.session, req.token)
            if not rows:  # also what a worker restart leaves: its new epoch dropped the reservation
                raise KVStoreError("conflict", "unknown, completed or rolled-back reservation token (a worker "
                                   "that restarted since prepare_store drops its reservations)", token=req.token)
            expired = rows[0].expires_at < now
            failed, good, checksums = [], [], {}
            for replica_id, epoch, _, block_id, block_hash, worker_epoch in rows:
                report = reports.get(block_hash)
                if expired or report is None or not report.ok or report.checksum is None or epoch != worker_epoch:
                    failed.append(replica_id)
                else:
                    good.append(replica_id)
                    checksums[block_id] = report.checksum
            repo.commit_replicas(tx.session, good, checksums)
            self._roll_back(tx, repo.replica_rows(tx.session, failed))
            committed = len(rows) - len(failed)
        self.metrics.blocks_committed.inc(committed)
        if expired:
            raise KVStoreError("conflict", "the reservation expired before completion; nothing was committed",
                               token=req.token)
        return specs.StoreCompleted(committed=committed, rolled_back=len(rows) - committed)

    def renew(self, token: str) -> specs.Renewed:
        """Extend a reader's lease or a writer's reservation by its TTL from now (a long transfer)."""
        now = self._clock()
        with self._tx() as tx:
            leases = repo.leases_with_token(tx.session, token)
            if leases and all(lease.expires_at >= now for lease in leases):
                expires_at = now + self.settings.lease_ttl_s
                for lease in leases:
                    lease.expires_at = expires_at
                return specs.Renewed(token=token, expires_at=expires_at)
            writing = [r for r, _, _, _ in repo.replicas_with_token(tx.session, token, WRITING)]
            if writing and all(r.expires_at is not None and r.expires_at >= now for r in writing):
                expires_at = now + self.settings.reservation_ttl_s
                for replica in writing:
                    replica.expires_at = expires_at
                return specs.Renewed(token=token, expires_at=expires_at)
        raise KVStoreError("conflict", "unknown, completed or expired token; it cannot be renewed", token=token)

    def recover(self) -> int:
        """At start: reservations open when the directory stopped are rolled back (their writers got
        no answer they could trust), moves that were in flight are undone, and every live worker gets
        a full heartbeat timeout to check in (the directory's own downtime is not their silence)."""
        with self._tx() as tx:
            rows = repo.replicas_in_state(tx.session, WRITING)
            self._roll_back(tx, rows)
            moving = repo.replicas_in_state(tx.session, MOVING)
            for replica, _, _ in moving:
                replica.state = READY
            now = self._clock()
            for worker in repo.workers(tx.session):
                if worker.state != "dead":  # a heartbeat timeout from now to check in again
                    worker.heartbeat_at = max(worker.heartbeat_at, now)
        if rows or moving:
            log.info("start-up: rolled back %d open reservations, %d moves in flight", len(rows), len(moving))
        return len(rows)

    def abort_store(self, token: str) -> int:
        with self._tx() as tx:
            rows = repo.replicas_with_token(tx.session, token, WRITING)
            self._roll_back(tx, [(r, t, w) for r, _, t, w in rows])
        return len(rows)

    def _roll_back(self, tx: Tx, rows: list[tuple[Replica, Tier, Worker]]) -> None:
        """Forget these replicas; their pages go back to live workers once the transaction commits."""
        frees: dict[str, list[tuple]] = {}
        for replica, tier, worker in rows:
            tier.used_bytes -= replica.reserved_bytes
            if tier.kind == "s3":
                block = tx.session.get(Block, replica.block_id)
                name = f"{block.namespace_id}/{block.hash}"
                frees.setdefault(worker.control_url, []).append((replica.token, [], name))
            elif replica.epoch == worker.epoch and worker.state != "dead":
                frees.setdefault(worker.control_url, []).append((replica.token, replica.pages))
        for url, items in frees.items():
            tx.after_commit.append(self._free_later(url, items))
        repo.drop_replicas(tx.session, [r.id for r, _, _ in rows])
        tx.session.flush()
        repo.delete_orphan_blocks(tx.session, list({r.block_id for r, _, _ in rows}))

    # ---- lookup and load ------------------------------------------------------------------

    def lookup(self, namespace_id: str, hashes: list[str]) -> specs.LookupResult:
        with self._tx() as tx:
            self._namespace(tx, namespace_id)
            hits, _ = self._leading_hits(tx, namespace_id, hashes)
            repo.touch_blocks(tx.session, [b.id for b, _, _, _ in hits], self._clock())
            self._policy_hits(tx, hits)
        self.metrics.count_lookup(len(hashes), len(hits))
        return _lookup_result(hits)

    def lookup_tokens(self, namespace_id: str, token_ids: list[int]) -> specs.TokenLookupResult:
        with self._tx() as tx:
            namespace = Namespace.from_dict(self._namespace(tx, namespace_id).spec)
        hashes = [h.hex() for h in block_hashes(namespace, token_ids)]
        result = self.lookup(namespace_id, hashes)
        return specs.TokenLookupResult(hit_tokens=result.num_hit_blocks * namespace.block_tokens,
                                       num_hit_blocks=result.num_hit_blocks, block_tokens=namespace.block_tokens)

    def prepare_load(self, req: specs.PrepareLoad) -> specs.LoadPrepared:
        batch = self.prepare_loads(specs.PrepareLoads(namespace_id=req.namespace_id, chains=[req.hashes],
                                                      reader=req.reader))
        return specs.LoadPrepared(token=batch.token, expires_at=batch.expires_at, blocks=batch.chains[0])

    def prepare_loads(self, req: specs.PrepareLoads) -> specs.LoadsPrepared:
        """Pin the leading hits an engine can read of every chain, under one token (a block that
        chains share is pinned once). One transaction when they all are in memory tiers; otherwise
        the NVMe-only ones are staged into DRAM first and the hits read again."""
        promoted = False
        while True:
            now = self._clock()
            with self._tx() as tx:
                self._namespace(tx, req.namespace_id)
                chains = [self._leading_hits(tx, req.namespace_id, hashes)[0] for hashes in req.chains]
                pinned = {hit[1].id: hit for hits in chains for hit in hits}  # replica id -> hit
                if promoted or all(tier.kind in READABLE_BY_ENGINES for _, _, tier, _ in pinned.values()):
                    chains = [_readable_prefix(hits) for hits in chains]
                    pinned = {hit[1].id: hit for hits in chains for hit in hits}
                    if not pinned:
                        return specs.LoadsPrepared(token=None, expires_at=None, chains=[[] for _ in chains])
                    token, expires_at = secrets.token_hex(16), now + self.settings.lease_ttl_s
                    repo.add_leases(tx.session, list(pinned), token, req.reader, expires_at)
                    repo.touch_blocks(tx.session, [b.id for b, _, _, _ in pinned.values()], now)
                    self._policy_hits(tx, list(pinned.values()))
                    break
            self.movement.promote(list(pinned.values()))  # stage NVMe-only blocks into DRAM first
            promoted = True
        for hashes, hits in zip(req.chains, chains):
            self.metrics.count_lookup(len(hashes), len(hits))
        return specs.LoadsPrepared(token=token, expires_at=expires_at,
                                   chains=[_lookup_result(hits).blocks for hits in chains])

    def complete_load(self, req: specs.CompleteLoad) -> specs.LoadCompleted:
        failed = {b.hash for b in req.blocks if not b.ok}
        with self._tx() as tx:
            pinned = repo.pinned_by_token(tx.session, req.token)
            if not pinned:
                raise KVStoreError("conflict", "unknown or expired lease token", token=req.token)
            invalidated = 0
            for replica, block in pinned:
                if block.hash in failed and replica.state != DELETING:
                    replica.state = DELETING  # no new pins; pages freed when the last pin goes
                    invalidated += 1
            repo.delete_leases(tx.session, req.token)
            tx.session.flush()
            if invalidated or any(r.state == DELETING for r, _ in pinned):
                self._collect_deleting(tx)
        self.metrics.checksum_failures.inc(invalidated)
        return specs.LoadCompleted(released=len(pinned), invalidated=invalidated)

    def _policy_hits(self, tx: Tx, hits) -> None:
        """Tell the tier policies, deepest block first (a prefix stays more recent than its suffixes)."""
        tiers_by_worker: dict[int, dict[str, Tier]] = {}
        for block, _, tier, worker in reversed(hits):
            if worker.id not in tiers_by_worker:  # once per worker (setdefault would query per block)
                tiers_by_worker[worker.id] = repo.tiers_of(tx.session, worker.id)
            tiers = tiers_by_worker[worker.id]
            self.policies.hit([tier] + [t for t in tiers.values() if t.id != tier.id],
                              block_key(block.namespace_id, block.hash))

    def _leading_hits(self, tx: Tx, namespace_id: str, hashes: list[str]):
        """The longest prefix of `hashes` with a visible replica, and the best replica of each."""
        blocks = repo.blocks_by_hash(tx.session, namespace_id, hashes)
        best: dict[int, tuple[Replica, Tier, Worker]] = {}
        for replica, tier, worker in repo.visible_replicas(tx.session, [b.id for b in blocks.values()]):
            current = best.get(replica.block_id)
            if current is None or TIER_PREFERENCE[tier.kind] < TIER_PREFERENCE[current[1].kind]:
                best[replica.block_id] = (replica, tier, worker)
        hits = []
        for h in hashes:
            block = blocks.get(h)
            if block is None or block.id not in best or block.checksum is None:
                break
            replica, tier, worker = best[block.id]
            hits.append((block, replica, tier, worker))
        return hits, [r.id for _, r, _, _ in hits]

    # ---- background -----------------------------------------------------------------------

    def reap(self) -> dict[str, int]:
        """Expire leases and reservations, declare silent workers dead, free deleted replicas."""
        now = self._clock()
        with self._tx() as tx:
            leases = repo.delete_expired_leases(tx.session, now)
            tokens = repo.expired_reservations(tx.session, now)
            for token in tokens:
                rows = repo.replicas_with_token(tx.session, token, WRITING)
                self._roll_back(tx, [(r, t, w) for r, _, t, w in rows])
            dead = self.membership.declare_dead(tx, now)
            draining = self.membership.finish_drains(tx)
            self._collect_deleting(tx)
        if leases or tokens or dead:
            log.info("reaper: %d expired pins, %d expired reservations, %d dead workers", leases, len(tokens), dead)
        drained = self.movement.drain(draining) if draining else 0
        demoted = self.movement.demote()
        copied = self.movement.write_through()
        return {"leases": leases, "reservations": len(tokens), "dead_workers": dead, "drained": drained,
                "demoted": demoted, "written_through": copied}

    def _collect_deleting(self, tx: Tx) -> None:
        rows = repo.replicas_in_state(tx.session, DELETING)
        pinned = repo.pinned_replica_ids(tx.session, [r.id for r, _, _ in rows])
        self._roll_back(tx, [row for row in rows if row[0].id not in pinned])

    # ---- operators ------------------------------------------------------------------------

    def evict_tier(self, req: specs.EvictRequest) -> specs.Evicted:
        with self._tx() as tx:
            targets = [(t.id, w.id) for t, w in repo.active_tiers(tx.session, req.tier)
                       if req.worker is None or w.name == req.worker]
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

    def evict(self, namespace_id: str | None) -> int:
        """Drop every visible replica (of one namespace, or all). Pinned ones go when unpinned."""
        with self._tx() as tx:
            rows = repo.visible_replica_rows(tx.session, namespace_id)
            for replica in rows:
                replica.state = DELETING
            tx.session.flush()
            self._collect_deleting(tx)
        log.info("evicted %d replicas%s", len(rows), f" of namespace {namespace_id}" if namespace_id else "")
        return len(rows)

    def tiers(self) -> list[specs.TierUsage]:
        with self._tx() as tx:
            return [specs.TierUsage(worker=w.name, kind=t.kind, capacity_bytes=t.capacity_bytes,
                                    used_bytes=t.used_bytes, num_blocks=n, page_bytes=t.page_bytes,
                                    high_watermark=t.high_watermark, low_watermark=t.low_watermark)
                    for t, w, n in repo.tier_usage(tx.session)]

    def stats(self) -> specs.Stats:
        with self._tx() as tx:
            return specs.Stats(**repo.counts(tx.session), replicas_by_tier=repo.replicas_by_tier(tx.session))

    # ---- helpers --------------------------------------------------------------------------

    def _namespace(self, tx: Tx, namespace_id: str) -> NamespaceRow:
        row = repo.namespace(tx.session, namespace_id)
        if row is None:
            raise KVStoreError("not_found", "unknown namespace; register it first (POST /v1/namespaces)",
                               namespace_id=namespace_id)
        return row

    def _worker_client(self, url: str) -> WorkerControlClient:
        if url not in self._worker_clients:
            self._worker_clients[url] = WorkerControlClient(url, timeout_s=10.0)
        return self._worker_clients[url]

    def _free_later(self, url: str, allocations: list[tuple]) -> Callable[[], None]:
        """A call that gives (token, page runs[, object name]) back to the worker; runs are PageRuns or
        [first, count]; an object name (s3) means: delete that object."""
        def free() -> None:
            if not allocations:
                return
            items = [specs.FreeItem(token=a[0], runs=[_page_run(r) for r in a[1]], object=a[2] if len(a) > 2 else None)
                     for a in allocations]
            self._worker_client(url).free(specs.FreeRequest(items=items))
        return free

    def close(self) -> None:
        for client in self._worker_clients.values():
            client.close()


def _page_run(run) -> specs.PageRun:
    return run if isinstance(run, specs.PageRun) else specs.PageRun(first=run[0], count=run[1])


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        try:
            call()
        except KVStoreError as exc:  # a worker that is gone keeps nothing: its epoch resets its pages
            log.warning("worker call after transaction failed: %s", exc)


def _readable_prefix(hits):
    """The leading hits a connector can read itself (a block left on NVMe ends the prefix)."""
    for i, (_, _, tier, _) in enumerate(hits):
        if tier.kind not in READABLE_BY_ENGINES:
            return hits[:i]
    return hits


def _check_sizes(namespace: NamespaceRow, blocks: list[specs.BlockToStore]) -> None:
    expected = Namespace.from_dict(namespace.spec).block_nbytes
    wrong = [b.hash for b in blocks if b.nbytes != expected]
    if wrong:
        raise KVStoreError("invalid", f"blocks of this namespace are {expected} bytes",
                           expected=expected, wrong_hashes=wrong[:5])


def _replica_states(session: Session, blocks: dict[str, Block]) -> dict[str, set[str]]:
    """Per block hash: READY if some replica is visible, WRITING if a live reservation exists."""
    by_id = {b.id: h for h, b in blocks.items()}
    states: dict[str, set[str]] = {}
    for replica, tier, worker in repo.replicas_of(session, list(by_id)):
        if repo.is_visible(replica, tier, worker):
            states.setdefault(by_id[replica.block_id], set()).add(READY)
        elif replica.state == WRITING and replica.epoch == worker.epoch:
            states.setdefault(by_id[replica.block_id], set()).add(WRITING)
    return states


def _placement(session: Session) -> tuple[Tier, Worker] | None:
    for kind in PLACEMENT_TIERS:
        choice = _roomiest(repo.active_tiers(session, kind))
        if choice is not None:
            return choice
    return None


def _roomiest(candidates: list[tuple[Tier, Worker]]) -> tuple[Tier, Worker] | None:
    def free(tier: Tier) -> float:
        return float("inf") if tier.capacity_bytes is None else tier.capacity_bytes - tier.used_bytes
    return max(candidates, key=lambda tw: free(tw[0]), default=None)


def _location(worker: Worker, tier: Tier, runs, nbytes: int) -> specs.ReplicaLocation:
    if tier.kind == "s3":  # one object: offsets within it
        return specs.ReplicaLocation.model_construct(worker=worker.name, epoch=worker.epoch,
                                                     agent_name=worker.agent_name, tier="s3", runs=[(0, nbytes)])
    spans = specs.page_spans(tier.base_addr, tier.page_bytes, runs, nbytes)
    return specs.ReplicaLocation.model_construct(worker=worker.name, epoch=worker.epoch, agent_name=worker.agent_name,
                                                 tier=tier.kind, runs=spans)


def _lookup_result(hits) -> specs.LookupResult:
    blocks, by_tier = [], {}
    for block, replica, tier, worker in hits:
        blocks.append(specs.BlockHit.model_construct(hash=block.hash, nbytes=block.nbytes, checksum=block.checksum,
                                     location=_location(worker, tier, replica.pages, block.nbytes)))
        by_tier[tier.kind] = by_tier.get(tier.kind, 0) + 1
    return specs.LookupResult(num_hit_blocks=len(blocks), blocks=blocks, by_tier=by_tier)
