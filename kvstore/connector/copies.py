"""Blocks between an engine's memory and workers' tiers: a plain copy when the worker's DRAM arena
is mapped here (same host), a NIXL transfer otherwise.

    arenas = LocalArenas(folder, mode)               # "auto" (default), "off"
    copier = BlockCopier(agent, peers, arenas, timeout_s)
    done, digests, far = copier.copy_local("WRITE" | "READ", [(block, location), ...])  # same host, hashed
    done, digests, far = copier.in_place(items, transform)  # a READ transformed straight out of the arena
    copier.move("WRITE" | "READ", [items[k] for k in far]) -> [done, ...]             # NIXL


A worker on this host hands its arena over a Unix socket (`<folder>/<worker name>.sock`, see
kvstore.worker.sharing); a location is copied directly only when its worker, agent and epoch are
the ones mapped (a worker that restarted has another agent: the connector maps it again). A
worker that cannot be mapped (another host, another user, sharing off) is asked again after
RETRY_S, and NIXL carries its blocks meanwhile. `KVSTORE_SAME_HOST=off` forces NIXL everywhere.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from kvstore.connector.peers import Peers
from kvstore.core import specs
from kvstore.core.local import peer_uid, trusted_folder
from kvstore.transfer import Agent, Transfer

log = logging.getLogger(__name__)
DEFAULT_FOLDER = "/tmp/kvstore"
RETRY_S = 10.0  # a worker that could not be mapped is asked again after this long
HANDOVER_TIMEOUT_S = 2.0


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
HASH_SHARE = 4  # blocks read in place are hashed this many to a task
Transform = Callable[[int, np.ndarray], list[Callable[[], None]]]  # (first item, its bytes and those after) -> copies


@dataclass(eq=False)  # one mapping each: compared (and weakly keyed) by identity
class _Arena:
    agent_name: str
    epoch: int
    base_addr: int
    array: np.ndarray
    mapping: mmap.mmap
    sock: socket.socket | None = None  # the worker's end closes when it exits


class LocalArenas:
    """The DRAM arenas of this host's workers, mapped on first use."""

    def __init__(self, folder: str | None = None, mode: str | None = None) -> None:
        self.mode = mode or os.environ.get("KVSTORE_SAME_HOST", "auto")
        if self.mode not in ("auto", "off"):
            raise ValueError(f"same-host mode {self.mode!r}: use auto or off")
        self.folder = Path(folder or os.environ.get("KVSTORE_ARENA_DIR", DEFAULT_FOLDER))
        self._arenas: dict[str, _Arena] = {}
        self._unmapped: dict[str, float] = {}  # worker -> when to try again
        self._mapping: dict[str, threading.Lock] = {}  # worker -> held while its arena is being mapped
        self._lock = threading.Lock()  # held only to read or change the dicts, never across I/O

    def view(self, location: specs.ReplicaLocation) -> _Arena | None:
        """The mapped arena holding this DRAM location, or None (NIXL carries it). A worker's arena
        is mapped by one caller at a time, outside the lock every copy takes: a slow or large
        worker's hand-over holds up only the copies waiting for that worker."""
        if self.mode == "off" or location.tier != "dram":
            return None
        worker = location.worker
        arena = self._arenas.get(worker)
        if arena is not None and _identity(arena) == _identity(location):
            return arena
        if arena is not None and location.epoch < arena.epoch:
            return None  # a location of the worker's past life: NIXL refuses it too; the mapping stays
        with self._lock:
            gate = self._mapping.setdefault(worker, threading.Lock())
        with gate:
            return self._remap(worker, location)

    def _remap(self, worker: str, location: specs.ReplicaLocation) -> _Arena | None:
        """Under `worker`'s gate: its mapping for `location`, mapped again if the worker restarted."""
        now = time.monotonic()
        with self._lock:
            arena = self._arenas.get(worker)
            if arena is not None and _identity(arena) == _identity(location):
                return arena  # mapped while this caller waited for the gate
            if self._unmapped.get(worker, 0.0) > now:
                return None
        fresh = self._map(worker)  # connect, receive, MAP_POPULATE: no lock held
        with self._lock:
            current = self._arenas.get(worker)
            if fresh is not None and current is not None and _identity(fresh) == _identity(current):
                _hang_up(fresh)  # the same life mapped already: keep that mapping
                fresh = current
            elif fresh is not None and (current is None or fresh.epoch > current.epoch):
                self._arenas[worker] = fresh  # the worker's present life, even if `location` is newer still
                if current is not None:
                    _hang_up(current)  # the worker restarted or joined again: its old mapping goes
            elif fresh is not None:
                _hang_up(fresh)
            if fresh is None or _identity(fresh) != _identity(location):
                self._unmapped[worker] = now + RETRY_S
                return None
            self._unmapped.pop(worker, None)
            return fresh

    def close(self) -> None:
        with self._lock:  # the mappings go with their last view
            arenas, self._arenas = list(self._arenas.values()), {}
        for arena in arenas:
            _hang_up(arena)

    def _map(self, worker: str) -> _Arena | None:
        """The arena `worker` hands over its socket, if the folder and the worker are this user's
        (or root's) and the memfd cannot shrink under the mapping; None otherwise. The socket
        stays open while the arena is mapped: its end is the worker's exit (`_watch`)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            arena = self._handover(worker, sock)
        except FileNotFoundError:
            arena = None  # no worker of that name shares an arena on this host
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.info("cannot map worker %s's arena (%s): NIXL carries its blocks", worker, exc)
            arena = None
        if arena is None:
            sock.close()
            return None
        log.info("worker %s's DRAM arena mapped (%d bytes): same-host copies", worker, arena.array.size)
        threading.Thread(target=self._watch, args=(worker, arena), name="kvstore-arena-watch", daemon=True).start()
        return arena

    def _handover(self, worker: str, sock: socket.socket) -> _Arena | None:
        if not trusted_folder(self.folder, owners=(os.getuid(), 0), forbidden=0o022):
            log.info("%s is not a folder only this user or root can change: NIXL only", self.folder)
            return None
        sock.settimeout(HANDOVER_TIMEOUT_S)
        sock.connect(str(self.folder / f"{worker}.sock"))
        if peer_uid(sock) not in (os.getuid(), 0):
            log.warning("the socket of worker %s belongs to another user: NIXL only", worker)
            return None
        message, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        header = json.loads(message)
        if not fds:
            log.info("worker %s does not share its arena with this process: %s", worker, header.get("error"))
            return None
        try:
            if not fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                log.warning("worker %s's arena could shrink under a mapping: NIXL only", worker)
                return None
            mapping = mmap.mmap(fds[0], header["nbytes"], flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            for fd in fds:
                os.close(fd)
        sock.settimeout(None)
        return _Arena(header["agent_name"], int(header["epoch"]), int(header["base_addr"]),
                      np.frombuffer(mapping, dtype=np.uint8), mapping, sock)

    def _watch(self, worker: str, arena: _Arena) -> None:
        """Until the worker's end of the hand-over connection closes (it exited): then its arena is
        unmapped here, once the copies using it are done (they hold their own reference)."""
        try:
            while arena.sock.recv(4096):
                pass
        except OSError:
            pass
        arena.sock.close()
        with self._lock:
            if self._arenas.get(worker) is arena:
                del self._arenas[worker]
                log.info("worker %s exited: its DRAM arena is unmapped here", worker)


def _identity(where: _Arena | specs.ReplicaLocation) -> tuple[str, int]:
    return where.agent_name, where.epoch


def _hang_up(arena: _Arena) -> None:
    """End the hand-over connection of an arena this process no longer uses (its watcher ends)."""
    if arena.sock is not None:
        try:
            arena.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


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
        near = sorted((k for k, a in enumerate(arenas) if a is not None), key=lambda k: -items[k][0].nbytes)
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
            transfers.append((self.agent.submit(op, local, remote, peer, "DRAM", remote_mem) if peer else None, ks))
        for transfer, ks in transfers:
            state = transfer.wait(self.timeout_s) if transfer else "failed"
            if state != "done":
                log.warning("NIXL %s of %d blocks failed: %s", op, len(ks), transfer.error if transfer else
                            "worker unreachable")
            for k in ks:
                done[k] = state == "done"
        return done


def by_tier(locations: list[specs.ReplicaLocation]) -> dict[tuple[str, int, str], list[int]]:
    """The indices of `locations` per storage worker (name, epoch) and tier: one memory type, one
    NIXL request or arena each."""
    groups: dict[tuple[str, int, str], list[int]] = {}
    for k, location in enumerate(locations):
        groups.setdefault((location.worker, location.epoch, location.tier), []).append(k)
    return groups


def _copy_hashed(op: str, block: np.ndarray, location: specs.ReplicaLocation, arena: _Arena) -> tuple[bool, str]:
    """One block's runs copied chunk by chunk, each chunk hashed once copied, from this process's
    side: a WRITE hashes what it meant to write (its source, still in cache), never the arena,
    where a stale writer or another engine may have written since; a READ hashes what it got."""
    assert block.flags.c_contiguous, "a block is one contiguous buffer"
    flat = block.reshape(-1).view(np.uint8)
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


def arena_digest(arena: _Arena, runs: list[tuple[int, int]]) -> str:
    """xxh3_64 of a block's runs in a mapped arena ("" if one is outside it: never a stored checksum)."""
    digest = xxhash.xxh3_64()
    for addr, length in runs:
        at = addr - arena.base_addr
        if at < 0 or at + length > arena.array.size:
            return ""
        digest.update(arena.array[at:at + length])
    return digest.hexdigest()


def rows(items: list[tuple[np.ndarray, specs.ReplicaLocation]]) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor rows (address, length) of the blocks' memory and of their replicas' runs."""
    local, remote = [], []
    for buffer, location in items:
        addr = int(buffer.ctypes.data)
        for run_addr, run_len in location.runs:
            local.append((addr, run_len))
            remote.append((run_addr, run_len))
            addr += run_len
        assert addr == int(buffer.ctypes.data) + buffer.nbytes, "replica runs do not match the block size"
    return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)


def on_device(rows_: np.ndarray, device: int) -> np.ndarray:
    """(address, length) rows as (address, length, device) rows: memory on that GPU."""
    return np.c_[rows_, np.full(len(rows_), device, dtype=np.uint64)]


def remote_side(remote: np.ndarray, location: specs.ReplicaLocation) -> tuple[np.ndarray, str]:
    """(address, length) rows of replicas in `location`'s worker and tier as NIXL addresses them, and
    their memory type: an HBM tier's are in its GPU's memory (VRAM, on that device), the others in
    the worker's host memory."""
    return (on_device(remote, location.device), "VRAM") if location.tier == "hbm" else (remote, "DRAM")


def scatter(indices: list[int], oks: list[bool], sums: list[str], done: list[bool], digests: list[str]) -> None:
    """Results of a part of the items written back into the whole's lists."""
    for k, ok, digest in zip(indices, oks, sums):
        done[k], digests[k] = ok, digest
