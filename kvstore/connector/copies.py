"""Whole blocks between an engine's memory and workers' tiers: a plain copy when the worker's DRAM
arena is mapped here (same host, `arenas.LocalArenas`), a NIXL transfer otherwise.

    copier = BlockCopier(agent, peers, arenas, timeout_s)
    done, digests, far = copier.copy_local("WRITE" | "READ", [(block, location), ...])  # same host, hashed
    done, digests, far = copier.in_place(items, transform)  # a READ transformed straight out of the arena
    copier.move("WRITE" | "READ", [items[k] for k in far]) -> [done, ...]             # NIXL
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from kvstore.connector.arenas import Arena, LocalArenas, arena_digest
from kvstore.connector.nixl_rows import by_tier, remote_side, rows
from kvstore.connector.peers import Peers
from kvstore.core import specs
from kvstore.transfer import JOIN_BYTES, Agent, Transfer

log = logging.getLogger(__name__)


def _copy_threads() -> int:
    """Threads for same-host copies and checksums (numpy and xxhash release the GIL): KVSTORE_COPY_THREADS,
    else half the cores, 2 to 8."""
    said = os.environ.get("KVSTORE_COPY_THREADS", "")
    if said.isdigit() and int(said) > 0:
        return int(said)
    if said:
        log.warning("KVSTORE_COPY_THREADS=%r is not a positive whole number: the default is used", said)
    return min(8, max(2, (os.cpu_count() or 2) // 2))


COPY_THREADS = _copy_threads()
CHUNK_BYTES = 256 << 10  # copied, then hashed while it is still in cache
INLINE_BYTES = 1 << 20  # same-host copies of at most this many bytes in all run on the caller's thread
HASH_SHARE = 4  # blocks read in place are hashed this many to a task
Transform = Callable[[int, np.ndarray], list[Callable[[], None]]]  # (first item, its bytes and those after) -> copies


class BlockCopier:
    def __init__(self, agent: Agent, peers: Peers, arenas: LocalArenas, timeout_s: float) -> None:
        self.agent, self.peers, self.arenas, self.timeout_s = agent, peers, arenas, timeout_s
        self.pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvstore-copy")

    def copy_local(self, op: str, items: list[tuple[np.ndarray, specs.ReplicaLocation]]
                   ) -> tuple[list[bool], list[str], list[int]]:
        """The items whose arena is mapped here, copied in chunks, each chunk hashed right after it is
        copied (while it is in cache: the checksum costs no second pass over memory), on COPY_THREADS
        threads. Returns per item (copied, xxh3_64 of the bytes now at the destination; False and ""
        for the others) and the indices of the others, which NIXL must carry (`move`)."""
        arenas = [self.arenas.view(location) for _, location in items]
        done, digests = [False] * len(items), [""] * len(items)
        near = [k for k, a in enumerate(arenas) if a is not None]
        if sum(items[k][0].nbytes for k in near) <= INLINE_BYTES:  # a hand-off to the threads costs more
            for k in near:
                done[k], digests[k] = _copy_hashed(op, *items[k], arenas[k])
            return done, digests, [k for k, a in enumerate(arenas) if a is None]
        near.sort(key=lambda k: -items[k][0].nbytes)
        shares: list[list[int]] = [[] for _ in range(COPY_THREADS)]
        loads = [0] * COPY_THREADS
        for k in near:  # the largest first, each to the least loaded thread
            t = loads.index(min(loads))
            shares[t].append(k)
            loads[t] += items[k][0].nbytes
        futures = [self.pool.submit(lambda ks=ks: [(k, _copy_hashed(op, *items[k], arenas[k])) for k in ks])
                   for ks in shares if ks]
        for future in futures:
            for k, (ok, digest) in future.result():
                done[k], digests[k] = ok, digest
        return done, digests, [k for k, a in enumerate(arenas) if a is None]

    def in_place(self, items: list[tuple[np.ndarray, specs.ReplicaLocation]], transform: Transform
                 ) -> tuple[list[bool], list[str], list[int]]:
        """copy_local's READ for a caller that transforms blocks as it copies them out (the tensor
        API's store layout -> per-layer tensors): items whose block is one run of a mapped arena
        skip their buffer, `transform(k, bytes)` giving the copies out of items k, k+1, .. that lie
        one after the other there; a block in several runs goes through its buffer. The copies run
        on the copy threads, each block hashed in the arena beside them (a lease keeps it
        unchanged). A save never hashes the arena (another writer may have written there since):
        it packs into its buffers (`transform_buffers`) and writes them with copy_local. Returns as
        copy_local does."""
        arenas = [self.arenas.view(location) for _, location in items]
        far, staged, in_arena = [], [], []  # in_arena: (item, arena, offset, bytes) of one-run blocks
        for k, ((buffer, location), arena) in enumerate(zip(items, arenas)):
            if arena is None or len(location.runs) != 1:
                (far if arena is None else staged).append(k)  # a block in several runs goes through its buffer
                continue
            (addr, length), = location.runs
            at = addr - arena.base_addr
            if 0 <= at and at + length <= arena.array.size and length == buffer.nbytes:  # else NIXL would fail too
                in_arena.append((k, arena, at, length))
        futures = [self.pool.submit(copy) for k, arena, at, nbytes in _neighbours(in_arena)
                   for copy in transform(k, arena.array[at:at + nbytes])]
        through = [(k, self.pool.submit(_copy_hashed, "READ", *items[k], arenas[k])) for k in staged]
        near = [k for k, _, _, _ in in_arena]
        sums = [(ks, self.pool.submit(lambda ks=ks: [arena_digest(arenas[k], items[k][1].runs) for k in ks]))
                for ks in (near[i:i + HASH_SHARE] for i in range(0, len(near), HASH_SHARE))]
        copied = all(future.exception() is None for future in futures)  # waits for each
        done, digests = [False] * len(items), [""] * len(items)
        for ks, future in sums:
            for k, digest in zip(ks, future.result()):
                done[k], digests[k] = copied, digest
        for k, future in through:
            done[k], digests[k] = future.result()
        self.transform_buffers([(k, items[k][0]) for k, _ in through if done[k]], transform)
        return done, digests, far

    def transform_buffers(self, buffers: list[tuple[int, np.ndarray]], transform: Transform) -> None:
        """in_place's copies for items that go through their buffers, (index, buffer) (NIXL's: packed
        before it writes them, unpacked after it read them), on the copy threads: one set of copies
        per run of consecutive indices whose buffers follow each other in memory."""
        first = dict(buffers)
        runs = _neighbours([(k, None, buffer.ctypes.data, buffer.nbytes) for k, buffer in buffers])
        copies = [copy for k, _, _, nbytes in runs
                  for copy in transform(k, as_strided(first[k].reshape(-1).view(np.uint8), (nbytes,), (1,)))]
        for future in [self.pool.submit(copy) for copy in copies]:
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.arenas.close()

    def move(self, op: str, items: list[tuple[np.ndarray, specs.ReplicaLocation]]) -> list[bool]:
        """Per item whether its bytes arrived over NIXL: one request per worker and tier."""
        done = [False] * len(items)
        transfers: list[tuple[Transfer | None, list[int]]] = []
        for (worker, epoch, _), ks in by_tier([location for _, location in items]).items():
            peer = self.peers.agent_for(worker, epoch)
            local, remote = rows([items[k] for k in ks])
            remote, remote_mem = remote_side(remote, items[ks[0]][1])  # one tier of one worker: one device
            transfers.append((self.agent.submit(op, local, remote, peer, "DRAM", remote_mem, join_up_to=JOIN_BYTES)
                              if peer else None, ks))
        for transfer, ks in transfers:
            state = transfer.wait(self.timeout_s) if transfer else "failed"
            if state != "done":
                log.warning("NIXL %s of %d blocks failed: %s", op, len(ks), transfer.error if transfer else
                            "worker unreachable")
            for k in ks:
                done[k] = state == "done"
        return done


def _copy_hashed(op: str, block: np.ndarray, location: specs.ReplicaLocation, arena: Arena) -> tuple[bool, str]:
    """One block's runs copied chunk by chunk, each chunk hashed once copied, from this process's
    side: a WRITE hashes what it meant to write (its source, still in cache), never the arena,
    where a stale writer or another engine may have written since; a READ hashes what it got."""
    assert block.flags.c_contiguous, "a block is one contiguous buffer"
    flat = block.reshape(-1).view(np.uint8)
    if len(location.runs) == 1 and flat.size <= CHUNK_BYTES:  # one chunk: one copy, one call to hash it
        (addr, length), = location.runs
        offset = addr - arena.base_addr
        if offset < 0 or offset + length > arena.array.size or length != flat.size:
            return False, ""  # not in the arena mapped (NIXL would have failed too), or not this block's size
        there = arena.array[offset:offset + length]
        if op == "WRITE":
            np.copyto(there, flat)
        else:
            np.copyto(flat, there)
        return True, xxhash.xxh3_64_hexdigest(flat)
    digest = xxhash.xxh3_64()
    at = 0
    for addr, length in location.runs:
        offset = addr - arena.base_addr
        if offset < 0 or offset + length > arena.array.size:
            return False, ""  # not in the arena mapped: NIXL would have failed too
        for start in range(0, length, CHUNK_BYTES):
            n = min(CHUNK_BYTES, length - start)
            there = arena.array[offset + start : offset + start + n]
            here = flat[at + start : at + start + n]
            if op == "WRITE":
                np.copyto(there, here)
            else:
                np.copyto(here, there)
            digest.update(here)
        at += length
    return at == flat.size, digest.hexdigest()


def _neighbours(entries: list[tuple[int, object, int, int]]) -> list[tuple[int, object, int, int]]:
    """(index, where, at, bytes) entries joined into (first index, where, at, bytes of them all) per run
    of consecutive indices of one size, in one `where`, each starting where the one before ends."""
    runs: list[list] = []
    for k, where, at, nbytes in entries:
        last = runs[-1] if runs else None
        if last and last[0] + last[3] // nbytes == k and last[1] is where and last[2] + last[3] == at \
                and last[4] == nbytes:
            last[3] += nbytes
        else:
            runs.append([k, where, at, nbytes, nbytes])
    return [(k, where, at, total) for k, where, at, total, _ in runs]


def reindexed(transform: Transform, index: list[int], nbytes: int) -> Transform:
    """`transform` of blocks for items numbered apart from them (item k is block index[k]): items
    whose blocks do not follow one another are transformed block by block."""
    def run(k: int, raw: np.ndarray) -> list:
        n = raw.nbytes // nbytes
        if index[k + n - 1] - index[k] == n - 1:
            return transform(index[k], raw)
        return [c for j in range(n) for c in transform(index[k + j], raw[j * nbytes:(j + 1) * nbytes])]
    return run


def scatter(indices: list[int], oks: list[bool], sums: list[str], done: list[bool], digests: list[str]) -> None:
    """Results of a part of the items written back into the whole's lists."""
    for k, ok, digest in zip(indices, oks, sums):
        done[k], digests[k] = ok, digest
