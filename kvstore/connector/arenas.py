"""The DRAM arenas of this host's storage workers, mapped into this engine: the same-host path.

    arenas = LocalArenas(folder, mode)      # "auto" (default), "off" (NIXL everywhere)
    arena = arenas.view(location)           # the mapped Arena holding a DRAM location, or None: NIXL
    arena_digest(arena, runs) -> hex        # xxh3_64 of a block's runs there
    arenas.close()

`view` is the one place that decides between a plain copy and NIXL. A worker on this host hands its
arena over a Unix socket (`<folder>/<worker name>.sock`, see kvstore.worker.sharing); a location is
copied directly only when its worker, agent and epoch are the ones mapped (a worker that restarted
has another agent: the connector maps it again). A worker that cannot be mapped (another host,
another user, sharing off, past its limit of engines) is asked again after RETRY_S, and NIXL
carries its blocks meanwhile. `KVSTORE_SAME_HOST=off` forces NIXL everywhere.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvstore.core import specs
from kvstore.core.local import peer_uid, trusted_folder

log = logging.getLogger(__name__)
DEFAULT_FOLDER = "/tmp/kvstore"
RETRY_S = 10.0  # a worker that could not be mapped is asked again after this long
HANDOVER_TIMEOUT_S = 2.0


@dataclass(eq=False)  # one mapping each: compared (and weakly keyed) by identity
class Arena:
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
        self._arenas: dict[str, Arena] = {}
        self._unmapped: dict[str, float] = {}  # worker -> when to try again
        self._mapping: dict[str, threading.Lock] = {}  # worker -> held while its arena is being mapped
        self._lock = threading.Lock()  # held only to read or change the dicts, never across I/O

    def view(self, location: specs.ReplicaLocation) -> Arena | None:
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

    def _remap(self, worker: str, location: specs.ReplicaLocation) -> Arena | None:
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

    def _map(self, worker: str) -> Arena | None:
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

    def _handover(self, worker: str, sock: socket.socket) -> Arena | None:
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
        return Arena(header["agent_name"], int(header["epoch"]), int(header["base_addr"]),
                      np.frombuffer(mapping, dtype=np.uint8), mapping, sock)

    def _watch(self, worker: str, arena: Arena) -> None:
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


def _identity(where: Arena | specs.ReplicaLocation) -> tuple[str, int]:
    return where.agent_name, where.epoch


def _hang_up(arena: Arena) -> None:
    """End the hand-over connection of an arena this process no longer uses (its watcher ends)."""
    if arena.sock is not None:
        try:
            arena.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass



def arena_digest(arena: Arena, runs: list[tuple[int, int]]) -> str:
    """xxh3_64 of a block's runs in a mapped arena ("" if one is outside it: never a stored checksum)."""
    digest = xxhash.xxh3_64()
    for addr, length in runs:
        at = addr - arena.base_addr
        if at < 0 or at + length > arena.array.size:
            return ""
        digest.update(arena.array[at:at + length])
    return digest.hexdigest()
