"""Which blocks move between tiers, and when (order hbm -> dram -> nvme -> s3, per worker).

    demote() -> n            # the reaper: tiers above their high watermark send the victims their
                             # eviction policy names one tier down (if the lower tier's admission
                             # keeps them) until the low watermark; the bottom tier drops them
    make_room(tier, nbytes)  # before a save or a promotion: the same, cascading down first
    drain(worker_ids)        # the reaper, for draining workers: memory tiers down, NVMe to S3
    evict(...)               # the operator's `kvstore evict`, with a dry run
    promote(hits)            # blocks a reader can only find on NVMe or S3 are copied into memory
    write_through() -> n     # the reaper: S3 copies for namespaces that ask for them

How a copy runs is `moves.Moves`; this module decides what to copy.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from kvstore.core import tiers
from kvstore.directory.db import moves as sql
from kvstore.directory.db import direct, repository as repo
from kvstore.directory.db.index import Index
from kvstore.directory.db.views import Hit
from kvstore.directory.db.models import Tier
from kvstore.directory.db.models.replica import DELETING
from kvstore.directory.moves.move import Moves
from kvstore.directory.tier_policies import TierPolicies, Unanswered, VictimRow, block_key
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.reclaim import Reclaim
from kvstore.core.pace import paced, tier_sized
from kvstore.directory.db.writer import Tx, Write
from kvstore.policies import Admit

log = logging.getLogger(__name__)
MAX_MOVES_PER_ROUND = 256
EVICT_BATCH = 64  # victims asked of a policy at once


class _Plan(NamedTuple):
    copy: dict[int, tuple[int, str, str]]  # replica id -> (block id, namespace, hash), to copy one tier down
    copy_bytes: int  # what they need below
    dest_kind: str | None
    dropped: int  # replicas dropped (nothing below, or a copy below exists)
    dropped_bytes: int


class Movement:
    def __init__(self, write: Write, moves: Moves, reclaim: Reclaim, pools: PagePools, policies: TierPolicies,
                 reserved_bytes: Callable[[int], int] = lambda tier_id: 0, promote_timeout_s: float | None = None,
                 read: Write | None = None) -> None:
        self._write = write
        self._topology: Index = moves.topology  # workers and tiers as of the last commit
        self._read = read or write  # a job that only reads, off the writer
        self._promote_timeout_s = promote_timeout_s  # a reader waits on a promotion: no longer than its lease
        self._reserved = reserved_bytes  # tier id -> bytes that saves hold reserved (not in SQL yet)
        self.moves = moves
        self._reclaim = reclaim
        self._pools = pools
        self._policies = policies
        self._loading: Counter = Counter()  # block ids being staged for readers: no demotion takes them
        self._loading_lock = threading.Lock()

    # ---- demotion ----------------------------------------------------------------------

    def demote(self) -> int:
        def pressured(tx: Tx):
            return [(t.id, w.id, _above_low(t, self._reserved(t.id))) for kind in ("hbm", "dram", "nvme")
                    for t, w in repo.active_tiers(tx.session, kind) if _over_high(t, self._reserved(t.id))]
        return sum(self._demote_tier(t, w, n, set())["demoted"] for t, w, n in self._write(pressured))

    def make_room(self, tier_id: int, worker_id: int, nbytes: int, protected: set[int] = frozenset()) -> None:
        """Before placing `nbytes` on a tier: demote enough that they fit, down to the low watermark
        when that asks for more; blocks in `protected` (being loaded) stay."""
        tier, worker = self._topology.tiers.get(tier_id), self._topology.workers.get(worker_id)
        if tier is None or worker is None or (tier.kind in tiers.MEMORY and
                                              nbytes <= self._pools.free_bytes(tier_id, worker.epoch)):
            return  # the common case: it fits, no SQL

        short = self._read(lambda tx: self._shortfall(tx, tier.id, tier.kind, worker.epoch, nbytes))
        if short > 0:
            self._demote_tier(tier_id, worker_id, short, set(protected), limit=1 << 30)

    def _shortfall(self, tx: Tx, tier_id: int, kind: str, epoch: int, nbytes: int) -> int:
        """What must leave the tier before `nbytes` fit on it (down to its low watermark once it has
        to make room at all); 0 when they fit."""
        fill = sql.tier_fill(tx.session, tier_id)
        if fill is None or not fill[0]:
            return 0
        capacity, used, low_watermark = fill
        free = self._pools.free_bytes(tier_id, epoch) if kind in tiers.MEMORY else capacity - used
        if nbytes <= free:
            return 0
        return max(nbytes - free, used + nbytes - int(low_watermark * capacity))

    @tier_sized()
    def evict(self, tier_id: int, worker_id: int, max_bytes: int | None, namespace_id: str | None,
              limit: int, dry_run: bool) -> dict:
        """Operator eviction: up to `limit` blocks (and `max_bytes`) that the tier's eviction policy
        names go one tier down, or are dropped at the bottom. `dry_run` only says what would go."""
        to_free = max_bytes if max_bytes is not None else 1 << 62
        if dry_run:  # at the bottom every victim would be dropped, above it moved down; read off the writer
            totals = None
            if namespace_id is None:
                self._build_policy(tier_id)  # then asked without a copy, or a read of the tier per dry run
                totals = self._dry_run_elsewhere(tier_id, limit, to_free)
            if totals is None:
                chosen = self._read(lambda tx: self._victims(tx, repo.tier(tx.session, tier_id), to_free, set(),
                                                             namespace_id, limit, dry_run=True))
                totals = len(chosen), sum(r.reserved_bytes for r, _ in chosen)
            lower = _lower(self._topology, tier_id, worker_id)
            return {"replicas": totals[0], "bytes": totals[1],
                    "demoted": totals[0] if lower else 0, "dropped": 0 if lower else totals[0]}
        return self._demote_tier(tier_id, worker_id, to_free, set(), namespace_id, limit)

    def _demote_tier(self, tier_id: int, worker_id: int, to_free: int, protected: set[int],
                     namespace_id: str | None = None, limit: int = MAX_MOVES_PER_ROUND) -> dict:
        outcome = {"replicas": 0, "bytes": 0, "demoted": 0, "dropped": 0}
        total = 0
        if namespace_id is None:
            self._build_policy(tier_id)
        while total < to_free and outcome["replicas"] < limit:  # rounds of at most MAX_MOVES_PER_ROUND
            lower = _lower(self._topology, tier_id, worker_id)
            if lower is not None and self.moves.backing_off(lower[0]):
                break  # the tier below failed lately: keep the blocks where they are until it is retried
            round_limit = min(MAX_MOVES_PER_ROUND, limit - outcome["replicas"])
            route = self.moves.route(worker_id, tier_id, lower[1]) if lower is not None else None
            with self.moves.waited(worker_id) as token:
                deadline, timeout_s = self.moves.deadline()
                plan, reserved = self._write(lambda tx: self._plan_and_reserve(
                    tx, tier_id, worker_id, to_free - total, protected, namespace_id, round_limit, route, token,
                    deadline))
                if reserved is not None:  # the tier below had room: one job before the copy, one after
                    moved = self.moves.run(*reserved, deadline, timeout_s, source_stays=False)
                elif plan.copy:  # cascade: the tier below makes room first (SQL's view; the topology may lag it)
                    if lower is not None and lower[2]:
                        self.make_room(lower[0], worker_id, plan.copy_bytes, protected)
                    moved = self.moves.copy(worker_id, tier_id, plan.dest_kind, list(plan.copy), source_stays=False)
                else:
                    moved = {}
            for replica_id, (block_id, its_namespace, block_hash) in plan.copy.items():
                if replica_id not in moved:  # still READY here: the policy must name it again
                    self._policies.changed([(block_id, None, its_namespace, block_hash, [tier_id], [])])
            freed = sum(moved.values()) + plan.dropped_bytes
            outcome = {"replicas": outcome["replicas"] + len(plan.copy) + plan.dropped,
                       "bytes": outcome["bytes"] + freed, "demoted": outcome["demoted"] + len(moved),
                       "dropped": outcome["dropped"] + plan.dropped}
            total += freed
            if len(moved) + plan.dropped == 0:
                break  # nothing more can go (pinned, protected, or the tier below is full)
        return outcome

    def _plan_and_reserve(self, tx: Tx, tier_id: int, worker_id: int, to_free: int, protected: set[int],
                          namespace_id: str | None, limit: int, route, token: str, deadline: float):
        """The round's plan, and the copies' reservation in the same job when the tier below has room
        for them ((plan, (route, moves)) ; else (plan, None): the caller makes room, then copies)."""
        plan = self._plan(tx, tier_id, worker_id, to_free, protected, namespace_id, limit)
        if not plan.copy or route is None or route.dest[1] != plan.dest_kind or \
                self._shortfall(tx, route.dest[0], route.dest[1], route.dest_epoch, plan.copy_bytes) > 0:
            return plan, None
        moves, route = self.moves.reserve(tx, route, list(plan.copy), token, deadline, only_ready=True)
        return plan, (route, moves)

    def _plan(self, tx: Tx, tier_id: int, worker_id: int, to_free: int, protected: set[int],
              namespace_id: str | None, limit: int) -> _Plan:
        with self._loading_lock:
            protected = protected | set(self._loading)
        # the tiers as SQL has them in this job (a lagging view could drop what could move); the worker's
        # backends from the topology, which is as of the last commit (one ORM read where there were three)
        own = repo.tiers_of(tx.session, worker_id)
        tier = next((t for t in own.values() if t.id == tier_id), None) or repo.tier(tx.session, tier_id)
        known = self._topology.workers.get(worker_id)
        backends = known.backends if known is not None else repo.worker(tx.session, worker_id).backends
        lower_kind = tiers.below(own, tier.kind, gds="GDS_MT" in backends)
        lower = own.get(lower_kind) if lower_kind else None
        victims = self._victims(tx, tier, to_free, protected, namespace_id, limit)
        kinds = sql.replica_kinds(tx.session, [b.id for _, b in victims])
        wanted = [(r, b) for r, b in victims if lower is not None and lower.kind not in kinds.get(b.id, set())]
        copy = {r.id: (b.id, b.namespace_id, b.hash) for r, b in self._kept_below(lower, wanted)}
        drop = [(r, b) for r, b in victims if r.id not in copy]  # the bottom tier, or a lower copy exists
        direct.set_states(tx.session, {r.id: DELETING for r, _ in drop})
        repo.touched(tx.session, {b.id for _, b in drop})
        self._reclaim.collect_deleting(tx)
        return _Plan(copy, sum(b.nbytes for r, b in victims if r.id in copy), lower.kind if lower is not None else None,
                     len(drop),
                     sum(r.reserved_bytes for r, _ in drop))

    def _victims(self, tx: Tx, tier: Tier, to_free: int, protected: set[int], namespace_id: str | None,
                 limit: int, dry_run: bool = False) -> list[tuple[sql.VictimReplica, sql.VictimBlock]]:
        """The tier's eviction policy names the victims; an operator's namespace eviction takes that
        namespace's blocks least recently used first."""
        if namespace_id is not None:
            return _by_recency(tx, tier.id, to_free, protected, limit, namespace_id)
        if not self._policies.local:  # the order is in another process: without it, SQL's order
            if dry_run or not self._policies.built(tier):
                return _by_recency(tx, tier.id, to_free, protected, limit)
            return self._victims_from_policy(tx, tier, to_free, protected, limit)
        if dry_run:
            peeked = self._policies.peek(tier, limit, sql.pinned_blocks(tx.session, tier.id) | protected)
            if peeked is not None:
                return _enough(sql.ready_replicas_of_blocks(tx.session, tier.id, peeked), to_free)
        if dry_run or not self._policies.built(tier):  # built before the job (_build_policy) unless it ran dry
            return self._policies.victims(tier, _victim_rows(tx, tier.id, self._topology.id_of), protected, to_free,
                                          limit, dry_run)
        return self._victims_from_policy(tx, tier, to_free, protected, limit)

    def _dry_run_elsewhere(self, tier_id: int, limit: int, to_free: int) -> tuple[int, int] | None:
        """(replicas, bytes) of a dry run that the process holding the tier's order walks and
        re-checks in SQL; None where the order is this process's (or that process is not there)."""
        tier = self._topology.tiers.get(tier_id)
        if self._policies.local or tier is None:
            return None
        keep = self._read(lambda tx: sql.pinned_blocks(tx.session, tier_id))
        return self._policies.dry_run(tier, limit, keep, to_free)

    def _build_policy(self, tier_id: int) -> None:
        """The tier's eviction policy, built the first time from its READY replicas read off the
        writer (a job that read them held every save's commit for as long: 19 s at 1M blocks)."""
        tier = self._topology.tiers.get(tier_id)
        if tier is not None and not self._policies.built(tier):
            with tier_sized():
                self._policies.build(tier, lambda fill: self._read(lambda tx: sql.policy_rows(
                    tx.session, tier_id, fill, self._topology.id_of)))

    def _victims_from_policy(self, tx: Tx, tier: Tier, to_free: int, protected: set[int],
                             limit: int) -> list[tuple[sql.VictimReplica, sql.VictimBlock]]:
        """Ask the policy in batches and keep the keys the tier still holds READY and unpinned:
        the cost follows the victims, not the tier. A policy that runs dry is rebuilt once."""
        keep = sql.pinned_blocks(tx.session, tier.id) | protected
        chosen, freed = [], 0
        while freed < to_free and len(chosen) < limit:
            try:
                ids = self._policies.evict(tier, min(EVICT_BATCH, limit - len(chosen)), keep)
            except Unanswered:  # kept in another process, which cannot answer now
                if chosen:
                    break
                return _by_recency(tx, tier.id, to_free, protected, limit)
            if ids is None:
                if chosen:
                    break
                self._policies.unbuild(tier)  # ran dry with the tier over its mark: sync it again
                if self._policies.local:
                    return self._victims(tx, tier, to_free, protected, None, limit)
                # rebuilt in the other process, outside this job (the next round's _build_policy)
                return _by_recency(tx, tier.id, to_free, protected, limit)
            for replica, block in sql.ready_replicas_of_blocks(tx.session, tier.id, ids):
                if freed >= to_free or len(chosen) >= limit:
                    keep.add(block.id)
                    self._policies.changed([(block.id, None, block.namespace_id, block.hash, [tier.id], [])])
                    continue
                chosen.append((replica, block))
                freed += replica.reserved_bytes
        return chosen

    def _kept_below(self, lower: Tier | None, victims: list[tuple[sql.VictimReplica, sql.VictimBlock]]):
        """The victims the lower tier's admission finds worth keeping one tier down (asked at once)."""
        if not victims:
            return []
        decisions = self._policies.admit_many(lower, [(block_key(b.namespace_id, b.hash), b.nbytes, None)
                                                      for _, b in victims])
        return [victim for victim, decision in zip(victims, decisions) if isinstance(decision, Admit)]

    def drain(self, worker_ids: list[int]) -> int:
        """One round for draining workers: their memory tiers go down (dropped if there is no tier
        below), and NVMe goes to S3 when the worker has S3, so nothing is left only on its disk."""
        moved = 0
        for worker_id in worker_ids:
            own = self._write(lambda tx: {k: t.id for k, t in repo.tiers_of(tx.session, worker_id).items()})
            for kind in tiers.MEMORY + (("nvme",) if "s3" in own else ()):
                if kind in own:
                    outcome = self._demote_tier(own[kind], worker_id, 1 << 62, set())
                    moved += outcome["demoted"] + outcome["dropped"]
        return moved

    # ---- copies that keep the source ----------------------------------------------------------

    def write_through(self, limit: int = MAX_MOVES_PER_ROUND) -> int:
        """Copy blocks of write-through namespaces to their worker's S3 tier (the source stays)."""
        def candidates(tx: Tx) -> list[tuple[int, int, int]]:
            namespaces = sql.write_through_namespaces(tx.session)  # a small table: most ticks stop here
            return [(w.id, t.id, r.id) for r, _, t, w in
                    sql.write_through_candidates(tx.session, namespaces, limit)] if namespaces else []
        rows = self._write(candidates)
        by_source: dict[tuple[int, int], list[int]] = {}
        for worker_id, tier_id, replica_id in rows:
            by_source.setdefault((worker_id, tier_id), []).append(replica_id)
        copied = sum(len(self.moves.copy(w, t, "s3", ids, source_stays=True)) for (w, t), ids in by_source.items())
        if copied:
            log.info("write-through: %d blocks copied to S3", copied)
        return copied

    def promote(self, hits: list[Hit]) -> None:
        """Stage NVMe/S3-only hits into their worker's DRAM (NVMe into HBM when the worker has GDS:
        disk to GPU directly). The blocks being loaded are protected from the room this makes."""
        by_source: dict[tuple[int, int], list[Hit]] = {}
        for hit in hits:
            if hit.tier.kind in tiers.DURABLE and hit.worker.state == "active":  # a draining worker takes nothing in
                by_source.setdefault((hit.worker.id, hit.tier.id), []).append(hit)
        protected = {h.block_id for h in hits}
        with self._loading_lock:
            self._loading.update(protected)
        try:
            self._promote(by_source, protected)
        finally:
            with self._loading_lock:
                self._loading.subtract(protected)
                self._loading += Counter()  # drops the zero counts

    def _promote(self, by_source: dict, protected: set[int]) -> None:
        for (worker_id, tier_id), items in by_source.items():
            own = {k: t.id for k, t in self._topology.tiers_of(worker_id).items()}
            worker = self._topology.workers.get(worker_id)
            gds = worker is not None and "GDS_MT" in worker.backends
            kind = "hbm" if items[0].tier.kind == "nvme" and "hbm" in own and gds else "dram"
            if kind in own and not self.moves.backing_off(own[kind]):  # a route failing: not waited on
                self.make_room(own[kind], worker_id, sum(h.nbytes for h in items), protected)
                self.moves.copy(worker_id, tier_id, kind, [h.replica_id for h in items], source_stays=True,
                                timeout_s=self._promote_timeout_s)


def _lower(topology: Index, tier_id: int, worker_id: int) -> tuple[int, str, bool] | None:
    """(id, kind, bounded) of the tier below, or None at the bottom (or for a tier no longer known)."""
    tier, worker = topology.tiers.get(tier_id), topology.workers.get(worker_id)
    if tier is None or worker is None:
        return None
    own = topology.tiers_of(worker_id)
    kind = tiers.below(own, tier.kind, gds="GDS_MT" in worker.backends)
    return (own[kind].id, kind, own[kind].capacity_bytes is not None) if kind else None


def _over_high(tier: Tier, reserved: int) -> bool:
    return tier.capacity_bytes is not None and tier.used_bytes + reserved > tier.high_watermark * tier.capacity_bytes


def _above_low(tier: Tier, reserved: int) -> int:
    return max(0, tier.used_bytes + reserved - int(tier.low_watermark * (tier.capacity_bytes or 0)))


def _by_recency(tx: Tx, tier_id: int, to_free: int, protected: set[int], limit: int,
                namespace_id: str | None = None) -> list[tuple[sql.VictimReplica, sql.VictimBlock]]:
    """Least recently used first, as SQL orders them (of one namespace, or where no policy answers)."""
    candidates = sql.demotion_candidates(tx.session, tier_id, limit + len(protected), namespace_id)
    return _enough([(r, b) for r, b in candidates if b.id not in protected], to_free)[:limit]


def _enough(candidates: list[tuple[sql.VictimReplica, sql.VictimBlock]],
            to_free: int) -> list[tuple[sql.VictimReplica, sql.VictimBlock]]:
    chosen, freed = [], 0
    for replica, block in paced(candidates):
        if freed >= to_free:
            break
        chosen.append((replica, block))
        freed += replica.reserved_bytes
    return chosen


def _victim_rows(tx: Tx, tier_id: int, parent_id: sql.ParentId) -> list[VictimRow]:
    """Every READY replica of the tier, as the policies take them."""
    return [VictimRow(key=b.id, parent=parent, last_access=b.last_access, depth=b.depth, hit_count=b.hit_count,
                      nbytes=r.reserved_bytes, pinned=pinned, row=(r, b),
                      name=block_key(b.namespace_id, b.hash) if b.hit_count else "")
            for r, b, pinned, parent in sql.ready_replicas_of_tier(tx.session, tier_id, parent_id)]
