"""Copying blocks between two tiers of one worker, or into another worker's DRAM: reserve, move, finish.

    moves.copy(worker_id, source_tier_id, dest_kind, replica_ids, source_stays[, dest_worker_id])
        -> {replica id: bytes}
    moves.route(...), with moves.waited(worker_id) as token: moves.reserve(tx, ...) in the caller's
        job, then moves.run(...)     # the same, the reservation inside a job of the caller's
    moves.waiting() -> {token}       # moves this process waits on (any other WRITING move is an orphan)

A copy to another worker (`dest_worker_id`) is a UCX WRITE by the source worker into the
destination's arena, in pages of the directory's credit there; the destination worker then checks
each block's checksum (`POST /v1/verify`) before it counts.

Three steps, so no job spans worker I/O: one job before the worker's I/O, one after.
1. reserve (a job): the sources read, destination pages from the directory's
   page pool for a memory tier (none for S3; for NVMe only the bytes: the worker
   picks its disk pages inside the move) and a WRITING replica there that
   expires after the move's deadline; the source becomes MOVING (still readable).
2. move (worker I/O): the worker copies and checks the block's checksum. The
   request carries the deadline and the destination token; the worker refuses
   to start after the deadline and writes only pages held under that token (an
   NVMe destination's pages it takes under the token first, and names them in
   its answer).
3. finish (a job): the NVMe destinations' pages recorded; copied -> destination READY, source READY (a copy up) or
   DELETING (a move down). Failed -> destination dropped, source READY; a
   source that failed its checksum is invalidated. No answer (the worker may
   still be writing) -> the destination stays reserved until its deadline and
   the reaper rolls it back then, so its pages are never reused under a write,
   unless the worker that executes the move says sooner that it has stopped (orphans.py). An NVMe
   destination whose pages the directory never learnt goes back as every page its token holds.

A move's token names the worker that executes it (`move-<worker id>-<random>`): the source's.
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from kvstore.core import moving, specs, tiers
from kvstore.core.pages import pages_for
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


class _Route(NamedTuple):
    """Where a copy runs and lands, from the topology."""
    worker_url: str
    source: tuple  # (tier id, kind)
    dest: tuple  # (tier id, kind, page_bytes)
    dest_worker_id: int
    dest_epoch: int  # the destination worker's (the source's own unless a peer)
    dest_url: str
    peer: moving.Peer | None  # the destination worker, when it is another (its metadata read in the reservation)


class Moves:
    def __init__(self, write: Write, calls: WorkerCalls, reclaim: Reclaim, pools: PagePools, metrics: DirectoryMetrics,
                 topology: Index, clock: Callable[[], float] = time.time) -> None:
        self._write = write
        self.topology = topology  # workers and tiers as of the last commit: no SQL to find them
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
        route = self.route(worker_id, source_tier_id, dest_kind, dest_worker_id) if replica_ids else None
        if route is None:
            return {}
        with self.waited(worker_id) as token:
            deadline, timeout_s = self.deadline(timeout_s)
            plan, route = self._write(lambda tx: self.reserve(tx, route, replica_ids, token, deadline,
                                                              only_ready=not source_stays))
            return self.run(route, plan, deadline, timeout_s, source_stays)

    def deadline(self, timeout_s: float | None = None) -> tuple[float, float]:
        """(the move's deadline as unix time, the seconds to it): `timeout_s`, or the move timeout."""
        timeout_s = timeout_s or self._calls.move_timeout_s
        return self._clock() + timeout_s, timeout_s

    @contextmanager
    def waited(self, executor_id: int) -> Iterator[str]:
        """A move's token, counted as waited on (not an orphan) until the block ends: take it before
        the job that reserves under it."""
        token = move_token(executor_id)
        with self._waiting_lock:
            self._waiting.add(token)
        try:
            yield token
        finally:
            with self._waiting_lock:
                self._waiting.discard(token)

    def run(self, route: _Route, plan: list[_Move], deadline: float, timeout_s: float,
            source_stays: bool) -> dict[int, int]:
        """The worker's I/O for what `reserve` planned, then one job for its outcome."""
        if not plan:
            return {}
        t0 = time.perf_counter()
        result = self._calls.move(route.worker_url, [m.item for m in plan], deadline, route.peer, timeout_s)
        name = f"{route.source[1]}_{route.dest[1]}"  # spelt as the workers' kvstore_worker_moves route
        if route.peer is not None:
            name += " (another worker)"
            result = self._checked_at_peer(route, plan, result)
        self._note_outcome(route.dest[0], name, result)
        done = self._write(lambda tx: self._finish(tx, plan, result, source_stays, route.worker_url))
        log.debug("copied %d of %d blocks %s in %.1f ms", len(done), len(plan), name,
                  (time.perf_counter() - t0) * 1e3)
        return done

    def route(self, worker_id: int, source_tier_id: int, dest_kind: str,
              dest_worker_id: int | None = None) -> _Route | None:
        """Where a copy runs and lands, from the topology; None if a part is not known (or the other
        worker is not active). A copy to another worker goes DRAM to DRAM (else ValueError)."""
        workers = self.topology.workers
        worker, source = workers.get(worker_id), self.topology.tiers.get(source_tier_id)
        target = workers.get(dest_worker_id) if dest_worker_id is not None else worker
        if worker is None or source is None or target is None or (target.id != worker.id and target.state != "active"):
            return None
        dest = self.topology.tiers_of(target.id).get(dest_kind)
        if dest is None:
            return None
        peer = moving.Peer(agent_name=target.agent_name, agent_metadata="", base_addr=dest.base_addr,
                           page_bytes=dest.page_bytes) if target.id != worker.id else None
        if peer is not None and (source.kind, dest_kind) != ("dram", "dram"):
            raise ValueError("a copy to another worker goes DRAM to DRAM")
        return _Route(worker.control_url, (source.id, source.kind), (dest.id, dest.kind, dest.page_bytes),
                      target.id, target.epoch, target.control_url, peer)

    def reserve(self, tx: Tx, route: _Route, replica_ids: list[int], token: str, deadline: float,
                only_ready: bool) -> tuple[list[_Move], _Route]:
        """In the caller's job: destination replicas for the sources still readable (`token` from
        `waited`). A memory tier's pages come from this directory's pool; NVMe pages are the worker's
        to pick inside the move (only their bytes are reserved here); S3 takes none."""
        dest_id, dest_kind, page_bytes = route.dest
        worker_epoch = route.dest_epoch  # the destination's pages and its replica's epoch
        if route.peer is not None:
            metadata = repo.worker(tx.session, route.dest_worker_id).agent_metadata
            route = route._replace(peer=route.peer.model_copy(
                update={"agent_metadata": base64.b64encode(metadata).decode()}))
        sources = sql.move_sources(tx.session, replica_ids)
        plan, blocks, used = [], set(), 0
        for replica_id in replica_ids:
            source = sources.get(replica_id)
            readable = source is not None and source.checksum is not None and source.block_id not in blocks and \
                (source.state == READY or (not only_ready and source.state == MOVING))
            if not readable:
                continue
            pages = []
            if dest_kind in tiers.MEMORY:
                pairs = self._pools.allocate(dest_id, worker_epoch, source.nbytes)
                if pairs is None:
                    break  # the memory tier is full: what did not fit stays where it is
                tx.on_rollback.append(lambda p=pairs: self._pools.free(dest_id, worker_epoch, p))
                pages = [specs.PageRun(first=f, count=c) for f, c in pairs]
            blocks.add(source.block_id)  # one copy of a block per move
            reserved = source.nbytes if dest_kind == "s3" else pages_for(source.nbytes, page_bytes) * page_bytes
            used += reserved
            plan.append((replica_id, source, pages, reserved))
        expires_at = deadline + min(DEADLINE_SLACK_S, 3 * self._calls.move_timeout_s)
        dest_ids = direct.insert_replicas(tx.session, [
            (source.block_id, dest_id, worker_epoch, token, [[r.first, r.count] for r in pages], reserved,
             source.created_at) for _, source, pages, reserved in plan], state=WRITING, expires_at=expires_at)
        direct.set_states(tx.session, {replica_id: MOVING for replica_id, source, _, _ in plan
                                       if source.state == READY})
        repo.add_used(tx.session, {dest_id: used})  # no block to reload: a MOVING source reads as READY did
        moves = [_Move(source.block_id, replica_id, dest_ids[source.block_id],
                       _item(source, route.source[1], dest_kind, token, pages))
                 for replica_id, source, pages, _ in plan]
        return moves, route

    def _finish(self, tx: Tx, plan: list[_Move], result: moving.MoveResult, source_stays: bool,
                worker_url: str) -> dict[int, int]:
        done, dropped, unplaced, states, vanished = {}, [], [], {}, []
        found = sql.states_of(tx.session, [m.source_id for m in plan] + [m.dest_id for m in plan])
        codes = result.codes or ["ok" if ok else "failed" for ok in result.ok]
        picked = result.dst_runs or [None] * len(plan)  # pages the worker took for its NVMe destinations
        mine = {move.dest_id for move in plan if found.get(move.dest_id, ("", 0, ""))[2] == move.item.dst_token}
        direct.set_pages(tx.session, {move.dest_id: (move.item.dst_token, [[r.first, r.count] for r in runs])
                                      for move, runs in zip(plan, picked) if runs is not None and move.dest_id in mine})
        for move, code, runs in zip(plan, codes, picked):
            source, dest = found.get(move.source_id), found.get(move.dest_id) if move.dest_id in mine else None
            if dest is None and runs is not None:  # dropped meanwhile (its worker joined again, its deadline
                vanished.append((move.item.dst_token, runs))  # passed): the pages the worker named go back
            if code == "ok" and move.item.allocate and runs is None:
                code = "failed"  # copied, the worker says, but to pages it did not name: never recorded
            if code == "ok" and dest is not None and dest[0] == WRITING:
                states[move.dest_id] = READY
                if source is not None:
                    if not source_stays:
                        states[move.source_id] = DELETING
                    elif source[0] == MOVING:  # an evict or a failed checksum meanwhile: it stays DELETING
                        states[move.source_id] = READY
                    done[move.source_id] = source[1]
                continue
            if code != "unreachable" and dest is not None:  # the worker answered: nothing writes there any more
                (unplaced if move.item.allocate and runs is None else dropped).append(move.dest_id)
            if source is not None and code == "source_corrupt":
                states[move.source_id] = DELETING  # the copy we read from is bad
                self._metrics.checksum_failures.inc()
            elif source is not None and source[0] == MOVING:
                states[move.source_id] = READY
        direct.set_states(tx.session, states)
        repo.touched(tx.session, {m.block_id for m in plan})
        self._reclaim.drop(tx, repo.replica_rows(tx.session, dropped))
        self._reclaim.drop(tx, repo.replica_rows(tx.session, unplaced), give_back=False)  # the worker took no page
        if vanished:  # unless a replica holds them now (a worker that joined again reported the block: adopted)
            held = sql.pages_of_tokens(tx.session, {token for token, _ in vanished})
            tx.after_commit.append(self._calls.free_later(worker_url, [
                (token, runs) for token, runs in vanished
                if (token, tuple((r.first, r.count) for r in runs)) not in held]))
        self._reclaim.collect_deleting(tx)
        return done

    def _checked_at_peer(self, route: _Route, plan: list[_Move], result: moving.MoveResult) -> moving.MoveResult:
        """The destination worker hashes what it received; a block it does not confirm failed (its
        pages go back: the source answered, so nothing writes them any more)."""
        codes = list(result.codes or ["ok" if ok else "failed" for ok in result.ok])
        copied = [k for k, code in enumerate(codes) if code == "ok"]
        if not copied:
            return result
        matches = self._calls.verify(route.dest_url, [(route.dest[1], plan[k].item.dst_runs, plan[k].item.nbytes,
                                                       plan[k].item.checksum) for k in copied])
        errors = list(result.errors)
        for k, match in zip(copied, matches):
            if match is not True:
                codes[k] = "failed"
                errors[k] = "the destination worker did not confirm the block's checksum"
        if any(m is not True for m in matches):
            log.warning("%d of %d blocks copied to worker at %s not confirmed there",
                        sum(m is not True for m in matches), len(copied), route.dest_url)
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
                          checksum=source.checksum, namespace_id=source.namespace_id, hash=source.hash,
                          allocate=dest_kind == "nvme")
