"""The DRAM arena handed to engines on this host: a Unix socket that passes the arena's memfd.

    share = ArenaShare(path, arena, identity)   # identity() -> {"agent_name", "epoch"}
    share.start()                               # binds `path` (0600, in a 0700 folder); refused if a live
                                                # worker (of the same name) serves it
    share.stop()

An engine connects and receives, in one message, a JSON header (agent name, epoch, arena base
address and size, as the directory's replica locations use them) and the memfd (SCM_RIGHTS). It
then copies blocks straight between its memory and the arena: one copy per byte instead of a NIXL
transfer. The directory's protocol is unchanged (pages reserved before a write, leased before a
read, committed after the checksum); the engine checks that a location's agent and epoch are the
ones it mapped. The connection stays open while the worker lives: when the worker exits, however
it dies, the engine reads the end of it and unmaps the arena, so a dead worker's memory is not
kept alive by the engines that mapped it.

The credential is the kernel's: the socket is 0600 in a folder that must be this user's, 0700
(the worker does not share otherwise), and the peer's uid (SO_PEERCRED) must be this process's
(or root). Such a peer could as well attach to the worker with a debugger; an engine of another
user gets nothing and loads over NIXL. The engine checks the same of the worker (the folder
cannot be changed by others, the socket's process is its user's or root's) and that the memfd
is sealed against shrinking, so a mapping can never fault.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.core.local import peer_uid, trusted_folder
from kvstore.core.memory import HostBuffer

log = logging.getLogger(__name__)
MAX_ENGINES = 1024  # engine processes of this host holding the arena mapped; more are refused (NIXL carries theirs)
ACCEPT_PAUSE_S = 0.1  # after a failed accept(): out of descriptors stays so for a while, do not spin


class ArenaShare:
    def __init__(self, path: Path, arena: HostBuffer, identity: Callable[[], dict],
                 on_error: Callable[[str], None] = lambda reason: None) -> None:
        """`on_error(reason)`: counts a hand-over that failed ("accept", "too_many_engines")."""
        assert arena.fd is not None, "only a memfd-backed arena can be shared"
        self.path = Path(path)
        self._arena = arena
        self._identity = identity
        self._on_error = on_error
        self._sock: socket.socket | None = None
        self._inode = 0
        self._engines: set[socket.socket] = set()  # connections of engines that mapped the arena

    def start(self) -> None:
        """Raises OSError when the folder cannot be made, or is not this user's alone, and
        FileExistsError when a live process serves `path` (a worker of the same name: its socket
        stays, and engines keep mapping its arena)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not trusted_folder(self.path.parent, owners=(os.getuid(),), forbidden=0o077):
            raise PermissionError(f"{self.path.parent} must be a folder of this user with mode 0700")
        if _served(self.path):
            raise FileExistsError(f"a live process serves {self.path} (a worker of the same name?)")
        try:
            self.path.unlink()  # a dead predecessor's
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
            except OSError as exc:
                if self._sock is not sock:
                    return  # stopped
                self._on_error("accept")  # out of descriptors, an aborted connection...: serve on
                log.warning("accepting an engine's connection to the DRAM arena failed (%s); still serving",
                            errno.errorcode.get(exc.errno, exc))
                time.sleep(ACCEPT_PAUSE_S)
                continue
            try:
                shared = self._answer(conn)
            except OSError as exc:
                log.debug("an engine left during the arena hand-over: %s", exc)
                shared = False
            if shared:
                threading.Thread(target=self._hold, args=(conn,), name="arena-engine", daemon=True).start()
            else:
                conn.close()

    def _hold(self, conn: socket.socket) -> None:
        """Keep an engine's connection open while this worker lives: the engine reads its end of
        it, and the worker's exit (however it dies) closes it, so the engine unmaps the arena."""
        self._engines.add(conn)
        try:
            while conn.recv(4096):
                pass  # engines send nothing; an empty read is the engine gone
        except OSError:
            pass
        finally:
            self._engines.discard(conn)
            conn.close()

    def _answer(self, conn: socket.socket) -> bool:
        uid = peer_uid(conn)
        if uid not in (os.getuid(), 0):
            log.warning("a process of uid %d asked for the DRAM arena; refused (not this worker's user)", uid)
            conn.sendall(json.dumps({"error": "unauthorized"}).encode())
            return False
        if len(self._engines) >= MAX_ENGINES:  # it could not be told of this worker's exit: NIXL instead
            self._on_error("too_many_engines")
            conn.sendall(json.dumps({"error": f"{MAX_ENGINES} engines hold the arena mapped"}).encode())
            return False
        header = {**self._identity(), "base_addr": self._arena.addr, "nbytes": self._arena.nbytes}
        socket.send_fds(conn, [json.dumps(header).encode()], [self._arena.fd])
        return True

    def stop(self) -> None:
        sock, self._sock = self._sock, None  # first: the accept loop then knows its error is the stop
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for conn in list(self._engines):  # the engines unmap the arena
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            if os.stat(self.path).st_ino == self._inode:  # not a successor's socket
                self.path.unlink()
        except FileNotFoundError:
            pass


def _served(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at `path` (a stale file refuses them)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        return True
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError as exc:  # a full backlog is a live server too
        return exc.errno in (errno.EAGAIN, errno.ETIMEDOUT)
    finally:
        probe.close()
