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

The credential is the kernel's: the socket is 0600 in a folder that must be this user's, 0700
(the worker does not share otherwise), and the peer's uid (SO_PEERCRED) must be this process's
(or root). Such a peer could as well attach to the worker with a debugger; an engine of another
user gets nothing and loads over NIXL. The engine checks the same of the worker (the folder
cannot be changed by others, the socket's process is its user's or root's) and that the memfd
is sealed against shrinking, so a mapping can never fault.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore.core.local import peer_uid, trusted_folder
from kvstore.core.memory import HostBuffer

log = logging.getLogger(__name__)


class ArenaShare:
    def __init__(self, path: Path, arena: HostBuffer, identity: Callable[[], dict]) -> None:
        assert arena.fd is not None, "only a memfd-backed arena can be shared"
        self.path = Path(path)
        self._arena = arena
        self._identity = identity
        self._sock: socket.socket | None = None
        self._inode = 0

    def start(self) -> None:
        """Raises OSError when the folder cannot be made, or is not this user's alone."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not trusted_folder(self.path.parent, owners=(os.getuid(),), forbidden=0o077):
            raise PermissionError(f"{self.path.parent} must be a folder of this user with mode 0700")
        try:
            self.path.unlink()  # a predecessor's (names are unique among a directory's workers)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # the folder already keeps everyone else out
        self._inode = os.stat(self.path).st_ino
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
        uid = peer_uid(conn)
        if uid not in (os.getuid(), 0):
            log.warning("a process of uid %d asked for the DRAM arena; refused (not this worker's user)", uid)
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
            if os.stat(self.path).st_ino == self._inode:  # not a successor's socket
                self.path.unlink()
        except FileNotFoundError:
            pass
