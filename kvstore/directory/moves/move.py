"""Copying blocks between two tiers of one worker, or into another worker's DRAM: reserve, move, finish.

    moves.copy(worker_id, source_tier_id, dest_kind, replica_ids, source_stays[, dest_worker_id])
        -> {replica id: bytes}
    moves.waiting() -> {token}       # moves this process waits on (any other WRITING move is an orphan)

A copy to another worker (`dest_worker_id`) is a UCX WRITE by the source worker into the
destination's arena, in pages of the directory's credit there; the destination worker then checks
each block's checksum (`POST /v1/verify`) before it counts.

Three steps, so no job spans worker I/O:
1. reserve (a job): destination pages (the directory's page pool for a memory
   tier; none for S3; NVMe pages are allocated by the worker just before this
   job) and a WRITING replica there that expires after the move's deadline;
   the source becomes MOVING (still readable).
2. move (worker I/O): the worker copies and checks the block's checksum. The
   request carries the deadline and the destination token; the worker refuses
   to start after the deadline and writes only pages held under that token.
3. finish (a job): copied -> destination READY, source READY (a copy up) or
   DELETING (a move down). Failed -> destination dropped, source READY; a
   source that failed its checksum is invalidated. No answer (the worker may
   still be writing) -> the destination stays reserved until its deadline and
   the reaper rolls it back then, so its pages are never reused under a write,
   unless the worker that executes the move says sooner that it has stopped (orphans.py).

A move's token names the worker that executes it (`move-<worker id>-<random>`): the source's.
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from kvstore.core import moving, specs, tiers
from kvstore.directory.db import moves as sql
from kvstore.directory.db import direct, repository as repo
from kvstore.directory.db.index import Index
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.db.models.replica import DELETING, MOVING, READY, WRITING
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.reclaim import Reclaim
from kvstore.directory.workers.calls import WorkerCalls
from kvstore.directory.db.writer import Tx, Write

log = logging.getLogger(__name__)
DEADLINE_SLACK_S = 30.0  # a destination outlives the move's deadline by this much (at most 3 move timeouts)


class _Move(NamedTuple):
    block_id: int
    source_id: int
    dest_id: int
    item: moving.MoveItem


class _Source(NamedTuple):
    worker_url: str
    worker_epoch: int
    source: tuple  # (tier id, kind)
    dest: tuple | None  # (tier id, kind, page_bytes)
    rows: list  # (replica id, block id, nbytes)
    dest_epoch: int  # the destination worker's (the source's own unless a peer)
    dest_url: str
    peer: moving.Peer | None  # the destination worker, when it is another


class Moves:
    def __init__(self, write: Write, calls: WorkerCalls, reclaim: Reclaim, pools: PagePools, metrics: DirectoryMetrics,
                 topology: Index, clock: Callable[[], float] = time.time, read: Write | None = None) -> None:
        self._write = write
        self.topology = topology  # workers and tiers as of the last commit: no SQL to find them
        self._read = read or write  # a job that only reads, off the writer
        self._calls = calls
        self._reclaim = reclaim
        self._pools = pools
        self._metrics = metrics
        self._clock = clock
        self._backoff: dict[int, tuple[float, float]] = {}  # destination tier id -> (retry at, delay s)
        self._waiting: set[str] = set()  # tokens of the moves this process has reserved and not finished
        self._waiting_lock = threading.Lock()

    def waiting(self) -> set[str]:
        with self._waiting_lock:
            return set(self._waiting)

    def backing_off(self, tier_id: int) -> bool:
        return self._backoff.get(tier_id, (0.0, 0.0))[0] > time.monotonic()

    def copy(self, worker_id: int, source_tier_id: int, dest_kind: str, replica_ids: list[int],
             source_stays: bool, dest_worker_id: int | None = None, timeout_s: float | None = None) -> dict[int, int]:
        """The source replicas copied, with the bytes each held (freed by a move down once unpinned).
        `timeout_s`: the move's deadline from now (default: the move timeout)."""
        if not replica_ids:
            return {}
        found = self._sources(worker_id, source_tier_id, dest_kind, replica_ids, dest_worker_id)
        if found is None or found.dest is None or not found.rows:
            return {}
        if found.peer is not None and (found.source[1], dest_kind) != ("dram", "dram"):
            raise ValueError("a copy to another worker goes DRAM to DRAM")
        token = move_token(worker_id)
        with self._waiting_lock:
            self._waiting.add(token)
        try:
            return self._copy(found, token, dest_kind, source_stays, timeout_s or self._calls.move_timeout_s)
        finally:
            with self._waiting_lock:
                self._waiting.discard(token)

    def _copy(self, found: _Source, token: str, dest_kind: str, source_stays: bool, timeout_s: float) -> dict[int, int]:
        runs = None
        if found.dest[1] == "nvme":  # the worker owns its disk pages: ask it, outside every job
            runs = self._calls.allocate(found.worker_url, "nvme", token, [n for _, _, n in found.rows])
        deadline = self._clock() + timeout_s
        plan = self._write(lambda tx: self._reserve(tx, found, token, runs, deadline, only_ready=not source_stays))
        if not plan:
            return {}
        t0 = time.perf_counter()
        result = self._calls.move(found.worker_url, [m.item for m in plan], deadline, found.peer, timeout_s)
        route = f"{found.source[1]}_{found.dest[1]}"  # spelt as the workers' kvstore_worker_moves route
        if found.peer is not None:
            route += " (another worker)"
            result = self._checked_at_peer(found, plan, result)
        self._note_outcome(found.dest[0], route, result)
        done = self._write(lambda tx: self._finish(tx, plan, result, source_stays))
        log.debug("copied %d of %d blocks %s in %.1f ms", len(done), len(plan), route,
                  (time.perf_counter() - t0) * 1e3)
        return done

    def _sources(self, worker_id: int, source_tier_id: int, dest_kind: str, replica_ids: list[int],
                 dest_worker_id: int | None) -> _Source | None:
        """Where the copy runs and lands, from the topology; the replicas' blocks from SQL (the
        reservation checks the sources again)."""
        workers = self.topology.workers
        worker, source = workers.get(worker_id), self.topology.tiers.get(source_tier_id)
        target = workers.get(dest_worker_id) if dest_worker_id is not None else worker
        if worker is None or source is None or target is None or (target.id != worker.id and target.state != "active"):
            return None
        dest = self.topology.tiers_of(target.id).get(dest_kind)
        to_peer = target.id != worker.id and dest is not None
        pairs, metadata = self._read(lambda tx: (sql.replica_block_pairs(tx.session, replica_ids), repo.worker(
            tx.session, target.id).agent_metadata if to_peer else None))
        peer = moving.Peer(agent_name=target.agent_name, agent_metadata=base64.b64encode(metadata).decode(),
                           base_addr=dest.base_addr, page_bytes=dest.page_bytes) if to_peer else None
        return _Source(worker.control_url, worker.epoch, (source.id, source.kind),
                       (dest.id, dest.kind, dest.page_bytes) if dest is not None else None,
                       pairs, target.epoch, target.control_url, peer)

    def _reserve(self, tx: Tx, found: _Source, token: str, runs, deadline: float, only_ready: bool) -> list[_Move]:
        """Destination replicas for the sources still readable; what was allocated and not used goes back."""
        dest_id, dest_kind, page_bytes = found.dest
        worker_epoch = found.dest_epoch  # the destination's pages and its replica's epoch
        sources = sql.move_sources(tx.session, [r for r, _, _ in found.rows])
        plan, taken, blocks, used = [], set(), set(), 0
        for k, (replica_id, _, nbytes) in enumerate(found.rows):
            source = sources.get(replica_id)
            readable = source is not None and source.checksum is not None and source.block_id not in blocks and \
                (source.state == READY or (not only_ready and source.state == MOVING))
            pages = runs[k] if runs is not None else None
            if not readable or (runs is not None and pages is None):
                continue
            if dest_kind in tiers.MEMORY:
                pairs = self._pools.allocate(dest_id, worker_epoch, nbytes)
                if pairs is None:
                    break  # the memory tier is full: what did not fit stays where it is
                tx.on_rollback.append(lambda p=pairs: self._pools.free(dest_id, worker_epoch, p))
                pages = [specs.PageRun(first=f, count=c) for f, c in pairs]
            taken.add(k)
            blocks.add(source.block_id)  # one copy of a block per move
            pages = pages or []
            reserved = nbytes if dest_kind == "s3" else sum(r.count for r in pages) * page_bytes
            used += reserved
            plan.append((replica_id, source, pages, reserved))
        unused = [(token, r) for k, r in enumerate(runs or []) if r is not None and k not in taken]
        tx.after_commit.append(self._calls.free_later(found.worker_url, unused))
        expires_at = deadline + min(DEADLINE_SLACK_S, 3 * self._calls.move_timeout_s)
        dest_ids = direct.insert_replicas(tx.session, [
            (source.block_id, dest_id, worker_epoch, token, [[r.first, r.count] for r in pages], reserved,
             source.created_at) for _, source, pages, reserved in plan], state=WRITING, expires_at=expires_at)
        direct.set_states(tx.session, {replica_id: MOVING for replica_id, source, _, _ in plan
                                       if source.state == READY})
        repo.add_used(tx.session, {dest_id: used})  # no block to reload: a MOVING source reads as READY did
        return [_Move(source.block_id, replica_id, dest_ids[source.block_id],
                      _item(source, found.source[1], dest_kind, token, pages)) for replica_id, source, pages, _ in plan]

    def _finish(self, tx: Tx, plan: list[_Move], result: moving.MoveResult, source_stays: bool) -> dict[int, int]:
        done, dropped, states = {}, [], {}
        found = sql.states_of(tx.session, [m.source_id for m in plan] + [m.dest_id for m in plan])
        codes = result.codes or ["ok" if ok else "failed" for ok in result.ok]
        for move, code in zip(plan, codes):
            source, dest = found.get(move.source_id), found.get(move.dest_id)
            if code == "ok" and dest is not None and dest[0] == WRITING:
                states[move.dest_id] = READY
                if source is not None:
                    if not source_stays:
                        states[move.source_id] = DELETING
                    elif source[0] == MOVING:  # an evict or a failed checksum meanwhile: it stays DELETING
                        states[move.source_id] = READY
                    done[move.source_id] = source[1]
                continue
            if code != "unreachable" and dest is not None:
                dropped.append(move.dest_id)  # the worker answered: nothing writes those pages any more
            if source is not None and code == "source_corrupt":
                states[move.source_id] = DELETING  # the copy we read from is bad
                self._metrics.checksum_failures.inc()
            elif source is not None and source[0] == MOVING:
                states[move.source_id] = READY
        direct.set_states(tx.session, states)
        repo.touched(tx.session, {m.block_id for m in plan})
        self._reclaim.drop(tx, repo.replica_rows(tx.session, dropped))
        self._reclaim.collect_deleting(tx)
        return done

    def _checked_at_peer(self, found: _Source, plan: list[_Move], result: moving.MoveResult) -> moving.MoveResult:
        """The destination worker hashes what it received; a block it does not confirm failed (its
        pages go back: the source answered, so nothing writes them any more)."""
        codes = list(result.codes or ["ok" if ok else "failed" for ok in result.ok])
        copied = [k for k, code in enumerate(codes) if code == "ok"]
        if not copied:
            return result
        matches = self._calls.verify(found.dest_url, [(found.dest[1], plan[k].item.dst_runs, plan[k].item.nbytes,
                                                       plan[k].item.checksum) for k in copied])
        errors = list(result.errors)
        for k, match in zip(copied, matches):
            if match is not True:
                codes[k] = "failed"
                errors[k] = "the destination worker did not confirm the block's checksum"
        if any(m is not True for m in matches):
            log.warning("%d of %d blocks copied to worker at %s not confirmed there",
                        sum(m is not True for m in matches), len(copied), found.dest_url)
        return moving.MoveResult(ok=[c == "ok" for c in codes], errors=errors, codes=codes)

    def _note_outcome(self, dest_tier_id: int, route: str, result: moving.MoveResult) -> None:
        """Count failed moves; a route whose every move failed backs off (1 s doubling to 60 s)."""
        failed = len(result.ok) - sum(result.ok)
        if failed:
            self._metrics.move_failures.labels(route).inc(failed)
        if result.ok and not any(result.ok):
            delay = min(60.0, 2 * self._backoff.get(dest_tier_id, (0.0, 0.5))[1])
            self._backoff[dest_tier_id] = (time.monotonic() + delay, delay)
            log.warning("moves %s failed (%d blocks): %s; the blocks stay where they are, retrying in %.0fs",
                        route, failed, next((e for e in result.errors if e), "?"), delay)
        elif dest_tier_id in self._backoff and any(result.ok):
            del self._backoff[dest_tier_id]
            log.info("moves %s succeed again", route)


def move_token(executor_id: int) -> str:
    """A move's token: `move-` (recognised at a directory restart), the executing worker's id, a secret."""
    return f"move-{executor_id}-{secrets.token_hex(16)}"


def move_executor(token: str) -> int | None:
    """The id of the worker executing the move of `token`; None if the token does not say."""
    parts = token.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "move" and parts[1].isdigit() else None


def _item(source: sql.MoveSource, source_kind: str, dest_kind: str, token: str, runs) -> moving.MoveItem:
    return moving.MoveItem(src_kind=source_kind, src_runs=[specs.PageRun(first=f, count=c) for f, c in source.pages],
                          dst_kind=dest_kind, dst_runs=runs, dst_token=token, nbytes=source.nbytes,
                          checksum=source.checksum, namespace_id=source.namespace_id, hash=source.hash)
