"""What two processes of one host check of each other before sharing memory: that a folder only
its owner (or root) can change, and who is at the other end of a Unix socket."""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path


def trusted_folder(folder: Path, owners: tuple[int, ...], forbidden: int) -> bool:
    """`folder` is a real folder (not a link), owned by one of `owners`, without the `forbidden`
    permission bits: nobody else can put a socket of their own in it."""
    st = os.lstat(folder)
    return stat.S_ISDIR(st.st_mode) and st.st_uid in owners and not st.st_mode & forbidden


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return uid
