"""The DRAM arena handed to engines on this host: a Unix socket that passes the arena's memfd.

    share = ArenaShare(path, arena, identity)   # identity() -> {"agent_name", "epoch"}
    share.start()                               # binds `path` (0600, in a 0700 folder)
    share.stop()

An engine connects and receives, in one message, a JSON header (agent name, epoch, arena base
address and size, as the directory's replica locations use them) and the memfd (SCM_RIGHTS). It
then copies blocks straight between its memory and the arena: one copy per byte instead of a NIXL
transfer. The directory's protocol is unchanged (pages reserved before a write, leased before a
read, committed after the checksum); the engine checks that a location's agent and epoch are the
ones it mapped.

The credential is the kernel's: the socket is 0600 in a 0700 folder, and the peer's uid
(SO_PEERCRED) must be this process's (or root). Such a peer could as well attach to the worker
with a debugger; an engine of another user gets nothing and loads over NIXL.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore.core.memory import HostBuffer

log = logging.getLogger(__name__)


class ArenaShare:
    def __init__(self, path: Path, arena: HostBuffer, identity: Callable[[], dict]) -> None:
        assert arena.fd is not None, "only a memfd-backed arena can be shared"
        self.path = Path(path)
        self._arena = arena
        self._identity = identity
        self._sock: socket.socket | None = None

    def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.path.unlink()  # a predecessor's (names are unique among a directory's workers)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._sock.listen(64)
        threading.Thread(target=self._serve, args=(self._sock,), name="arena-share", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # stopped
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:
                    log.debug("an engine left during the arena hand-over: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        if uid not in (os.getuid(), 0):
            log.warning("process %d of uid %d asked for the DRAM arena; refused (not this worker's user)", pid, uid)
            conn.sendall(json.dumps({"error": "unauthorized"}).encode())
            return
        header = {**self._identity(), "base_addr": self._arena.addr, "nbytes": self._arena.nbytes}
        socket.send_fds(conn, [json.dumps(header).encode()], [self._arena.fd])

    def stop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
