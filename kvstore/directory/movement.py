"""Moving blocks between tiers (order hbm -> dram -> nvme -> s3, per worker).

    demote() -> n            # the reaper: tiers above their high watermark send the victims their
                             # eviction policy names one tier down (if the lower tier's admission
                             # keeps them) until the low watermark; the bottom tier drops them
    make_room(tier, nbytes)  # before a save or a promotion: the same, cascading down first
    drain(worker_ids)        # the reaper, for draining workers: memory tiers down, NVMe to S3
    evict(...)               # the operator's `kvstore evict`, with a dry run
    promote(hits) -> ids     # blocks a reader can only find on NVMe or S3 are copied into DRAM
    write_through() -> n     # the reaper: S3 copies for namespaces that ask for them

Every move runs in three steps so no database transaction spans worker I/O:
reserve (destination pages + a WRITING replica; the source marked MOVING),
move (the worker copies and checks the checksum), commit (destination READY,
source DELETING — freed when its last pin goes) or roll back.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.directory import repository as repo
from kvstore.directory.models import Block, Replica, Tier, Worker
from kvstore.directory.models.replica import DELETING, MOVING, READY, WRITING
from kvstore.directory.policy import VictimRow, block_key
from kvstore.policies import Admit

log = logging.getLogger(__name__)
TIER_ORDER = ("hbm", "dram", "nvme", "s3")
MAX_MOVES_PER_ROUND = 256


@dataclass
class _Move:
    block_id: int
    source_id: int
    dest_id: int
    dest_tier_id: int
    item: specs.MoveItem


class Movement:
    def __init__(self, service) -> None:
        self.service = service  # DirectoryService: transactions, worker clients, roll-back
        self._backoff: dict[int, tuple[float, float]] = {}  # destination tier id -> (retry at, delay s)

    # ---- demotion ----------------------------------------------------------------------

    def demote(self) -> int:
        moved = 0
        with self.service._tx() as tx:
            pressured = [(t.id, w.id, _above_low(t)) for kind in ("hbm", "dram", "nvme")
                         for t, w in repo.active_tiers(tx.session, kind) if _over_high(t)]
        for tier_id, worker_id, to_free in pressured:
            moved += self._demote_tier(tier_id, worker_id, to_free, protected=set())["demoted"]
        return moved

    def make_room(self, tier_id: int, worker_id: int, nbytes: int, protected: set[int]) -> None:
        """Before placing `nbytes` on a memory tier: demote enough that they fit (down to the low
        watermark); blocks in `protected` (being loaded) stay."""
        with self.service._tx() as tx:
            tier = tx.session.get(Tier, tier_id)
            short = nbytes - (tier.capacity_bytes - tier.used_bytes) if tier.capacity_bytes else 0
            down_to_low = tier.used_bytes + nbytes - int(tier.low_watermark * (tier.capacity_bytes or 0))
        if short > 0:
            self._demote_tier(tier_id, worker_id, max(short, down_to_low), protected)

    def evict(self, tier_id: int, worker_id: int, max_bytes: int | None, namespace_id: str | None,
              limit: int, dry_run: bool) -> dict:
        """Operator eviction: up to `limit` blocks (and `max_bytes`) that the tier's eviction policy
        names go one tier down, or are dropped at the bottom. `dry_run` only says what would go."""
        to_free = max_bytes if max_bytes is not None else 1 << 62
        if dry_run:
            with self.service._tx() as tx:
                chosen = self._victims(tx, tx.session.get(Tier, tier_id), to_free, set(), namespace_id, limit,
                                       dry_run=True)
            return {"replicas": len(chosen), "bytes": sum(r.reserved_bytes for r, _ in chosen),
                    "demoted": 0, "dropped": 0}
        return self._demote_tier(tier_id, worker_id, to_free, set(), namespace_id, limit)

    def _demote_tier(self, tier_id: int, worker_id: int, to_free: int, protected: set[int],
                     namespace_id: str | None = None, limit: int = MAX_MOVES_PER_ROUND) -> dict:
        outcome = {"replicas": 0, "bytes": 0, "demoted": 0, "dropped": 0}
        with self.service._tx() as tx:
            tier = tx.session.get(Tier, tier_id)
            lower = _next_tier(repo.tiers_of(tx.session, worker_id), tier.kind, tx.session.get(Worker, worker_id))
            lower_id = lower.id if lower is not None and lower.capacity_bytes is not None else None
            backing_off = lower is not None and self._backoff.get(lower.id, (0.0, 0.0))[0] > time.monotonic()
        if backing_off:
            return outcome  # the tier below failed lately: keep the blocks where they are until it is retried
        if lower_id is not None:  # cascade: the tier below makes room first
            self.make_room(lower_id, worker_id, to_free, protected)
        t0 = time.perf_counter()
        plan, lower_url, dropped = self._plan_demotion(tier_id, worker_id, to_free, protected, namespace_id, limit)
        outcome = {"replicas": len(plan) + len(dropped), "bytes": sum(dropped), "demoted": 0, "dropped": len(dropped)}
        if plan:
            t1 = time.perf_counter()
            result = self._move(lower_url, plan)
            t2 = time.perf_counter()
            self._finish(plan, result, dest_state=READY)
            route = f"{plan[0].item.src_kind} -> {plan[0].item.dst_kind}"
            self._note_outcome(lower.id, route, result)
            log.info("demoted %d blocks %s (%d failed): plan %.1f ms, move %.1f ms, commit %.1f ms",
                     sum(result.ok), route, len(plan) - sum(result.ok), (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                     (time.perf_counter() - t2) * 1e3)
            outcome["demoted"] = sum(result.ok)
            outcome["bytes"] += sum(m.item.nbytes for m, ok in zip(plan, result.ok) if ok)
        return outcome

    def _plan_demotion(self, tier_id: int, worker_id: int, to_free: int, protected: set[int],
                       namespace_id: str | None, limit: int):
        svc = self.service
        with svc._tx() as tx:
            tier = tx.session.get(Tier, tier_id)
            worker = tx.session.get(Worker, worker_id)
            lower = _next_tier(repo.tiers_of(tx.session, worker_id), tier.kind, worker)
            victims = self._victims(tx, tier, to_free, protected, namespace_id, limit)
            kinds = repo.replica_kinds(tx.session, [b.id for _, b in victims])
            copy = [(r, b) for r, b in victims if lower is not None and lower.kind not in kinds.get(b.id, set())
                    and self._keep_below(lower, b)]
            drop = [r for r, b in victims if (r, b) not in copy]
            for replica in drop:  # the bottom tier, or a lower copy exists already
                replica.state = DELETING
            plan = self._reserve(tx, worker, tier, lower, copy) if copy else []
            tx.session.flush()
            svc._collect_deleting(tx)
            return plan, worker.control_url, [r.reserved_bytes for r in drop]

    def _victims(self, tx, tier: Tier, to_free: int, protected: set[int], namespace_id: str | None,
                 limit: int, dry_run: bool = False) -> list[tuple[Replica, Block]]:
        """The tier's eviction policy names the victims; an operator's namespace eviction takes that
        namespace's blocks least recently used first."""
        if namespace_id is not None:
            candidates = repo.demotion_candidates(tx.session, tier.id, limit + len(protected), namespace_id)
            return _enough([(r, b) for r, b in candidates if b.id not in protected], to_free)[:limit]
        rows = [VictimRow(key=block_key(b.namespace_id, b.hash),
                          parent=block_key(b.namespace_id, b.parent) if b.parent else None,
                          last_access=b.last_access, depth=b.depth, hit_count=b.hit_count, nbytes=r.reserved_bytes,
                          pinned=pinned, row=(r, b))
                for r, b, pinned in repo.ready_replicas_of_tier(tx.session, tier.id)]
        keep = {row.key for row in rows if row.row[1].id in protected}
        return self.service.policies.victims(tier, rows, keep, to_free, limit, dry_run)

    def _keep_below(self, lower: Tier, block: Block) -> bool:
        """The lower tier's admission: is this victim worth keeping one tier down?"""
        decision = self.service.policies.admit(lower, block_key(block.namespace_id, block.hash), block.nbytes)
        return isinstance(decision, Admit)

    def _reserve(self, tx, worker: Worker, source: Tier, dest: Tier, victims) -> list[_Move]:
        """Pages on `dest` and a WRITING replica there for each victim that fits; sources become MOVING."""
        token = secrets.token_hex(16)
        client = self.service._worker_client(worker.control_url)
        answer = client.allocate(specs.AllocRequest(token=token, kind=dest.kind, sizes=[b.nbytes for _, b in victims]))
        reserved = []
        for (replica, block), runs in zip(victims, answer.runs):
            if runs is None:
                break  # the lower tier is full: what did not fit stays where it is
            nbytes = block.nbytes if dest.kind == "s3" else sum(r.count for r in runs) * dest.page_bytes
            row = Replica(block_id=block.id, tier_id=dest.id, epoch=worker.epoch, state=WRITING, token=token,
                          pages=[[r.first, r.count] for r in runs], reserved_bytes=nbytes,
                          expires_at=None, created_at=replica.created_at)
            tx.session.add(row)
            dest.used_bytes += row.reserved_bytes
            replica.state = MOVING
            reserved.append((replica, block, runs, row))
        extra = [(token, runs) for runs in answer.runs[len(reserved):] if runs is not None]
        tx.after_commit.append(self.service._free_later(worker.control_url, extra))
        tx.session.flush()
        return [_Move(block.id, replica.id, row.id, dest.id, _item(replica, source, dest, token, runs, block))
                for replica, block, runs, row in reserved]

    def drain(self, worker_ids: list[int]) -> int:
        """One round for draining workers: their memory tiers go down (dropped if there is no tier
        below), and NVMe goes to S3 when the worker has S3, so nothing is left only on its disk."""
        moved = 0
        for worker_id in worker_ids:
            with self.service._tx() as tx:
                tiers = {k: t.id for k, t in repo.tiers_of(tx.session, worker_id).items()}
            for kind in ("hbm", "dram") + (("nvme",) if "s3" in tiers else ()):
                if kind in tiers:
                    outcome = self._demote_tier(tiers[kind], worker_id, 1 << 62, set())
                    moved += outcome["demoted"] + outcome["dropped"]
        return moved

    # ---- write-through ---------------------------------------------------------------------

    def write_through(self, limit: int = MAX_MOVES_PER_ROUND) -> int:
        """Copy blocks of write-through namespaces to their worker's S3 tier (the source stays)."""
        with self.service._tx() as tx:
            rows = repo.write_through_candidates(tx.session, limit)
        copied = 0
        by_source: dict[tuple[int, int], list] = {}
        for replica, block, tier, worker in rows:
            by_source.setdefault((worker.id, tier.id), []).append(replica.id)
        for (worker_id, tier_id), ids in by_source.items():
            copied += len(self._copy(worker_id, tier_id, "s3", ids, only_ready=True))
        if copied:
            log.info("write-through: %d blocks copied to S3", copied)
        return copied

    # ---- promotion ---------------------------------------------------------------------

    def promote(self, hits) -> set[int]:
        """Stage NVMe/S3-only hits into their worker's DRAM (NVMe into HBM when the worker has GDS:
        disk to GPU directly); returns the block ids now in a memory tier."""
        promoted: set[int] = set()
        by_source: dict[tuple[int, int], list] = {}
        for block, replica, tier, worker in hits:
            if tier.kind in ("nvme", "s3") and worker.state == "active":  # a draining worker takes nothing in
                by_source.setdefault((worker.id, tier.id), []).append((block, replica, tier, worker))
        protected = {b.id for b, _, _, _ in hits}
        for (worker_id, tier_id), items in by_source.items():
            worker, source = items[0][3], items[0][2]
            with self.service._tx() as tx:
                tiers = repo.tiers_of(tx.session, worker_id)
            kind = "hbm" if source.kind == "nvme" and "hbm" in tiers and "GDS_MT" in worker.backends else "dram"
            if kind in tiers:
                self.make_room(tiers[kind].id, worker_id, sum(b.nbytes for b, _, _, _ in items), protected)
            promoted |= self._copy(worker_id, tier_id, kind, [r.id for _, r, _, _ in items], only_ready=False)
        return promoted

    def _copy(self, worker_id: int, source_id: int, dest_kind: str, replica_ids: list[int],
              only_ready: bool) -> set[int]:
        """Copy these replicas from one tier of a worker to its `dest_kind` tier; the sources stay.
        Returns the block ids copied."""
        with self.service._tx() as tx:
            worker = tx.session.get(Worker, worker_id)
            source = tx.session.get(Tier, source_id)
            dest = repo.tiers_of(tx.session, worker_id).get(dest_kind)
            rows = repo.replica_block_pairs(tx.session, replica_ids)
            rows = [(r, b) for r, b in rows if r.state == READY or not only_ready]
            plan = self._reserve(tx, worker, source, dest, rows) if dest is not None and rows else []
            url = worker.control_url
        if not plan:
            return set()
        result = self._move(url, plan)
        self._note_outcome(plan[0].dest_tier_id, f"{plan[0].item.src_kind} -> {dest_kind}", result)
        return self._finish(plan, result, dest_state=READY, source_stays=True)

    # ---- both ----------------------------------------------------------------------------

    def _move(self, url: str, plan: list[_Move]) -> specs.MoveResult:
        """The worker's move; a worker that cannot be reached failed every item (rolled back by _finish)."""
        try:
            return self.service._worker_client(url).move(specs.MoveRequest(items=[m.item for m in plan]))
        except KVStoreError as exc:
            return specs.MoveResult(ok=[False] * len(plan), errors=[str(exc)] * len(plan))

    def _note_outcome(self, dest_tier_id: int, route: str, result: specs.MoveResult) -> None:
        """Count failed moves; a route whose every move failed backs off (1 s doubling to 60 s)."""
        failed = len(result.ok) - sum(result.ok)
        if failed:
            self.service.metrics.move_failures.labels(route).inc(failed)
        if result.ok and not any(result.ok):
            delay = min(60.0, 2 * self._backoff.get(dest_tier_id, (0.0, 0.5))[1])
            self._backoff[dest_tier_id] = (time.monotonic() + delay, delay)
            log.warning("moves %s failed (%d blocks): %s; the blocks stay where they are, retrying in %.0fs",
                        route, failed, next((e for e in result.errors if e), "?"), delay)
        elif dest_tier_id in self._backoff and any(result.ok):
            del self._backoff[dest_tier_id]
            log.info("moves %s succeed again", route)

    def _finish(self, plan: list[_Move], result: specs.MoveResult, dest_state: str,
                source_stays: bool = False) -> set[int]:
        svc, done = self.service, set()
        with svc._tx() as tx:
            failed = []
            rows = repo.replicas_by_id(tx.session, [m.source_id for m in plan] + [m.dest_id for m in plan])
            for move, ok, error in zip(plan, result.ok, result.errors):
                source, dest = rows.get(move.source_id), rows.get(move.dest_id)
                if ok and dest is not None:
                    dest.state = dest_state
                    if source is not None:
                        source.state = READY if source_stays else DELETING
                    done.add(move.block_id)
                    continue
                if dest is not None:
                    failed.append(dest.id)
                if source is not None and error and "checksum mismatch after reading" in error:
                    source.state = DELETING  # the copy we read from is corrupt
                    svc.metrics.checksum_failures.inc()
                elif source is not None and source.state == MOVING:
                    source.state = READY
            svc._roll_back(tx, repo.replica_rows(tx.session, failed))
            tx.session.flush()
            svc._collect_deleting(tx)
        return done


def _next_tier(tiers: dict[str, Tier], kind: str, worker: Worker) -> Tier | None:
    """The next tier down that this worker has, or None at the bottom. A worker with GDS sends HBM
    straight to NVMe (GPU to disk without a bounce through host memory)."""
    if kind == "hbm" and "nvme" in tiers and "GDS_MT" in worker.backends:
        return tiers["nvme"]
    below = TIER_ORDER[TIER_ORDER.index(kind) + 1:]
    return next((tiers[k] for k in below if k in tiers), None)


def _over_high(tier: Tier) -> bool:
    return tier.capacity_bytes is not None and tier.used_bytes > tier.high_watermark * tier.capacity_bytes


def _above_low(tier: Tier) -> int:
    return max(0, tier.used_bytes - int(tier.low_watermark * (tier.capacity_bytes or 0)))


def _enough(candidates: list[tuple[Replica, Block]], to_free: int) -> list[tuple[Replica, Block]]:
    chosen, freed = [], 0
    for replica, block in candidates:
        if freed >= to_free:
            break
        chosen.append((replica, block))
        freed += replica.reserved_bytes
    return chosen


def _item(replica: Replica, source: Tier, dest: Tier, token: str, runs, block: Block) -> specs.MoveItem:
    return specs.MoveItem(src_kind=source.kind, src_runs=[specs.PageRun(first=f, count=c) for f, c in replica.pages],
                          dst_kind=dest.kind, dst_runs=runs, dst_token=token, nbytes=block.nbytes,
                          checksum=block.checksum, namespace_id=block.namespace_id, hash=block.hash)
