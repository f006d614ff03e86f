"""One layer's pages of many stored blocks copied between this process's registered memory and a
worker's mapped DRAM arena (the same-host path of the vLLM connector and of layer-wise loads).

    memory = HostMemory(); memory.add(addr, nbytes)  # an engine's own buffers (vLLM's pages)
    copy = copy_layer(op, [(addr, runs), ...], start, end, memory, arena, pool)   # a transfer
    copier = LayerCopier(slots, runs); copier.copy(op, base, step, start, end, memory, arena, pool)  # planned once
    groups = by_worker([(block id, location), ...], agent_for)  # per worker and tier: .peer, .blocks, .copier
    copy.poll() / copy.wait(timeout_s) -> "pending" | "done" | "failed"          # as NIXL's
    copy_pages(op, [(addr, runs, hasher), ...], start, end, memory, arena) -> LocalCopy  # page by page, hashed

Bytes [start, end) of each block (its `runs` in the arena, (addr, len) in the worker's address
space) go to or come from this process's memory at `addr`. Pieces of equal size at constant
steps on both sides (a layer's page of consecutive blocks: vLLM's pages one after the other,
the blocks one after the other in the arena) become one strided numpy copy, and the batches are
split by bytes across the pool's threads, which numpy lets copy without the GIL. Nothing is
hashed here: a load's blocks are hashed where they are contiguous, in the arena
(`page_checksums.ArenaHashes`), a save's in its own pages (`page_checksums.saved_checksums`).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvstore.connector.arenas import Arena
from kvstore.connector.copies import COPY_THREADS
from kvstore.connector.nixl_rows import by_tier

POLL_S = 200e-6  # how often a copy or a layer is polled: the poller shares the cores with the model
INLINE_BYTES = 1 << 20  # smaller copies run on the caller's thread: a hand-off to the pool costs more
Batch = tuple[int, int, int, int, int, int]  # (addr here, offset in the arena, bytes, count, step here, step there)


class HostMemory:
    """This process's buffers that descriptor rows may point into, as numpy views (an engine's
    registered pages): `view(addr, n)` is bytes [addr, addr + n) of the buffer holding them."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._arrays: list[np.ndarray] = []

    def add(self, addr: int, nbytes: int) -> None:
        k = bisect.bisect(self._bases, addr)
        self._bases.insert(k, addr)
        self._arrays.insert(k, np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr)))

    def view(self, addr: int, n: int) -> np.ndarray | None:
        k = bisect.bisect(self._bases, addr) - 1
        if k < 0 or addr + n > self._bases[k] + self._arrays[k].size:
            return None
        offset = addr - self._bases[k]
        return self._arrays[k][offset:offset + n]


class LocalCopy:
    """A transfer that already ended on the caller's thread: what a NIXL `Transfer` answers."""

    def __init__(self, ok: bool, error: str | None = None) -> None:
        self.state, self.error = ("done", None) if ok else ("failed", error)

    def poll(self) -> str:
        return self.state

    def wait(self, timeout_s: float | None = None) -> str:
        return self.state


def copy_pages(op: str, pages: list[tuple[int, list[tuple[int, int]], object]], start: int, end: int,
               memory: HostMemory, arena: Arena) -> LocalCopy:
    """Bytes [start, end) of stored blocks, each in its `runs` (addr, len) of a mapped arena, copied
    with this process's memory from `addr` on: "WRITE" here -> there, "READ" there -> here. Per
    block (addr, runs, hasher or None): one copy per piece of a run, and the hasher fed each piece
    right after it is copied, while it is in cache. On the caller's thread: xxhash holds the GIL
    for a page, and a second thread measured no faster here."""
    for here, runs, hasher in pages:
        offset = 0  # where the current run starts within the block
        for run_addr, run_len in runs:
            lo, hi = max(start, offset), min(end, offset + run_len)
            if lo < hi:
                mine, at = memory.view(here + lo - start, hi - lo), run_addr + lo - offset - arena.base_addr
                if mine is None or at < 0 or at + hi - lo > arena.array.size:
                    return LocalCopy(False, "a page outside the registered memory or the mapped arena")
                theirs = arena.array[at:at + hi - lo]
                target = theirs if op == "WRITE" else mine
                np.copyto(target, mine if op == "WRITE" else theirs)
                if hasher is not None:
                    hasher.update(target)
            offset += run_len
    return LocalCopy(True)


class PoolCopy:
    """A copy running on the pool: what a NIXL `Transfer` answers. An empty one is done."""

    def __init__(self, futures: list[Future], error: str | None = None) -> None:
        self._futures, self._error = futures, error

    @property
    def error(self) -> str | None:
        if self._error is None and self.poll() == "failed":
            return next(str(f.exception()) for f in self._futures if f.exception() is not None)
        return self._error

    def poll(self) -> str:
        if self._error is not None:
            return "failed"
        if not all(f.done() for f in self._futures):
            return "pending"
        return "done" if all(f.exception() is None for f in self._futures) else "failed"

    def wait(self, timeout_s: float | None = None) -> str:
        concurrent.futures.wait(self._futures, timeout_s)
        return self.poll()

    def settle(self) -> None:
        """Until no copy of it runs any more (they are memory copies: they end): before the lease or
        reservation they copy under is released, even when they were given up on as late."""
        concurrent.futures.wait(self._futures)


def copy_layer(op: str, pages: list[tuple[int, list[tuple[int, int]]]], start: int, end: int,
               memory: HostMemory, arena: Arena, pool: Executor, threads: int = COPY_THREADS) -> PoolCopy:
    """`op` "WRITE" copies here -> arena, "READ" arena -> here. A piece outside the registered
    memory or the mapped arena fails the whole copy before anything is copied. Planned with numpy:
    the thread posting a layer holds the GIL for little, so the copy threads are not kept waiting."""
    return _start(op, _plan(*pieces(pages, start, end), threads), 0, -arena.base_addr, memory, arena, pool)


class LayerCopier:
    """`copy_layer` for one set of blocks, layer after layer (a load's or a save's): block k's page
    of a layer is at `base + slots[k] x step` here, and at bytes [start, end) of its `runs` there.
    When every block is one run, a layer's pieces are the first layer's shifted on both sides, so
    they are planned once: posting a layer is then a few numpy views, not a plan per block."""

    def __init__(self, slots: list[int], runs: list[list[tuple[int, int]]]) -> None:
        self._slots, self._runs = slots, runs
        self._whole = min((r[0][1] for r in runs), default=0) if all(len(r) == 1 for r in runs) else 0
        self._plans: dict[tuple[int, int, int], Plan] = {}  # (step, bytes, threads) -> plan from 0

    def copy(self, op: str, base: int, step: int, start: int, end: int, memory: HostMemory, arena: Arena,
             pool: Executor, threads: int = COPY_THREADS) -> PoolCopy:
        if end > self._whole:  # a block in several runs, or shorter than [start, end): planned as it is
            pages = [(base + slot * step, runs) for slot, runs in zip(self._slots, self._runs)]
            return copy_layer(op, pages, start, end, memory, arena, pool, threads)
        plan = self._plans.get((step, end - start, threads))
        if plan is None:
            here = np.array(self._slots, dtype=np.int64) * step
            there = np.array([runs[0][0] for runs in self._runs], dtype=np.int64)
            plan = self._plans[(step, end - start, threads)] = _plan(
                here, there, np.full(len(here), end - start, dtype=np.int64), threads)
        return _start(op, plan, base, start - arena.base_addr, memory, arena, pool)


class BlockGroup:
    """Blocks in one storage worker's tier, moved layer by layer: (block id, location) and (block id,
    runs) of each, their pages in a layer here (`pages`: block b's at base + b x step), their copier."""

    def __init__(self, peer: str | None, items: list) -> None:
        self.peer, self.items = peer, items  # the worker's agent (None: unknown); [(block id, location)]
        self.blocks = [(block_id, location.runs) for block_id, location in items]
        self.copier = LayerCopier([block_id for block_id, _ in self.blocks], [runs for _, runs in self.blocks])

    def pages(self, base: int, step: int) -> list[tuple[int, list[tuple[int, int]]]]:
        return [(base + block_id * step, runs) for block_id, runs in self.blocks]


def by_worker(items: list, agent_for: Callable[[str, int], str | None]) -> list[BlockGroup]:
    """(block id, location) items as one BlockGroup per storage worker and tier (one memory type
    each), with that worker's agent (`agent_for(worker, epoch)`)."""
    return [BlockGroup(agent_for(worker, epoch), [items[k] for k in ks])
            for (worker, epoch, _), ks in by_tier([location for _, location in items]).items()]


Plan = tuple[list[list[Batch]], int, int]  # each thread's batches; the lowest and highest address there


def _plan(here: np.ndarray, at: np.ndarray, n: np.ndarray, threads: int) -> Plan:
    if not len(n):
        return [], 0, 0
    shares = _shares(_batches(here, at, n), threads if int(n.sum()) >= INLINE_BYTES else 1)
    return shares, int(at.min()), int((at + n).max())


def _start(op: str, plan: Plan, here_shift: int, there_shift: int, memory: HostMemory, arena: Arena,
           pool: Executor) -> PoolCopy:
    """The planned batches moved by the shifts (here; there, to offsets in the arena), started."""
    shares, lowest, highest = plan
    if shares and (lowest + there_shift < 0 or highest + there_shift > arena.array.size):
        return PoolCopy([], "a page outside the mapped arena")
    views = []
    for share in shares:
        pairs = []
        for mine_at, there_at, size, count, step_here, step_there in share:
            mine = memory.view(mine_at + here_shift, (count - 1) * step_here + size)
            if mine is None:
                return PoolCopy([], "a page outside the registered memory")
            there_at += there_shift
            theirs = arena.array[there_at:there_at + (count - 1) * step_there + size]
            pairs.append((as_strided(mine, (count, size), (step_here, 1)),
                          as_strided(theirs, (count, size), (step_there, 1))))
        views.append([(t, m) if op == "WRITE" else (m, t) for m, t in pairs])  # (destination, source)
    if len(views) <= 1:  # small, or one thread: here and now
        done: Future = Future()
        try:
            done.set_result(_copy(views[0] if views else []))
        except Exception as exc:  # noqa: BLE001 - the transfer's error, as the pool's would be
            done.set_exception(exc)
        return PoolCopy([done])
    return PoolCopy([pool.submit(_copy, share) for share in views])


def _copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for destination, source in pairs:
        np.copyto(destination, source)


def pieces(pages, start: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(addr here, addr there, bytes) of bytes [start, end) of each block, split where its runs are."""
    rows = []
    for here, runs in pages:
        offset = 0  # where the run starts within the block
        for run_addr, run_len in runs:
            rows.append((here, run_addr, run_len, offset))
            offset += run_len
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    here, there, length, offset = np.array(rows, dtype=np.int64).T
    lo, hi = np.maximum(start, offset), np.minimum(end, offset + length)
    keep = lo < hi
    lo, hi = lo[keep], hi[keep]
    return here[keep] + lo - start, there[keep] + lo - offset[keep], hi - lo


def _batches(here: np.ndarray, at: np.ndarray, n: np.ndarray) -> list[Batch]:
    """Consecutive pieces of one size at constant, non-overlapping steps on both sides, as one
    batch each. Edge i joins piece i to piece i + 1; a batch is a run of joinable edges with one
    step, less an edge whose first piece already ended the batch before."""
    if not len(n):
        return []
    step_here, step_there = np.diff(here), np.diff(at)
    joins = (n[1:] == n[:-1]) & (step_here >= n[:-1]) & (step_there >= n[:-1])
    same = np.zeros(len(joins), dtype=bool)  # edge i continues the run of edge i - 1
    same[1:] = (step_here[1:] == step_here[:-1]) & (step_there[1:] == step_there[:-1]) & joins[:-1]
    starts = np.flatnonzero(joins & ~same)  # first edge of each run
    stops = np.flatnonzero(~joins | ~same)  # an edge that does not continue the run before it
    out: list[Batch] = []
    done = 0  # pieces [0, done) are in a batch

    def single(k: int) -> Batch:
        return (int(here[k]), int(at[k]), int(n[k]), 1, int(n[k]), int(n[k]))

    for first in starts.tolist():
        last = int(stops[np.searchsorted(stops, first, side="right")]) - 1 \
            if stops.size and stops[-1] > first else len(joins) - 1
        first = max(first, done)
        if first > last:
            continue
        out += [single(k) for k in range(done, first)]
        out.append((int(here[first]), int(at[first]), int(n[first]), last - first + 2,
                    int(step_here[first]), int(step_there[first])))
        done = last + 2
    return out + [single(k) for k in range(done, len(n))]
def _shares(batches: list[Batch], threads: int) -> list[list[Batch]]:
    """The batches cut into `threads` shares of about equal bytes (a batch split by rows where needed)."""
    total = sum(n * count for _, _, n, count, _, _ in batches)
    shares: list[list[Batch]] = [[] for _ in range(max(1, threads))]
    k, filled = 0, 0
    for here, at, n, count, step_here, step_there in batches:
        row = 0
        while row < count:
            if k == len(shares) - 1:
                take = count - row
            else:
                take = min(count - row, max(1, -(-(total * (k + 1) // len(shares) - filled) // n)))
            shares[k].append((here + row * step_here, at + row * step_there, n, take, step_here, step_there))
            filled, row = filled + take * n, row + take
            if k < len(shares) - 1 and filled * len(shares) >= total * (k + 1):
                k += 1
    return [share for share in shares if share]
