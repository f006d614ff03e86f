"""Page-aligned host buffers (mmap), usable by numpy, torch and NIXL: anonymous, or backed by a
memfd that other processes of this host can map (the worker's DRAM arena)."""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np


class HostBuffer:
    """`nbytes` of zero-filled, page-aligned host memory at a stable address. With `populate`, every
    page is faulted in now (about 0.25 s per GiB) instead of on its first write. With `shared`, the
    memory is a memfd (`fd`) mapped MAP_SHARED, which can be handed to another process."""

    def __init__(self, nbytes: int, populate: bool = False, shared: bool = False) -> None:
        assert nbytes > 0, "a buffer needs a positive size"
        self.nbytes = nbytes
        self.fd: int | None = None
        populate_flag = mmap.MAP_POPULATE if populate else 0
        if shared:  # sealed at its size: a process it is handed to can never see it shrink (SIGBUS)
            self.fd = os.memfd_create("kvstore-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | populate_flag)
        else:
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate_flag)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        assert 0 <= offset and offset + nbytes <= self.nbytes, "view outside the buffer"
        return self.array[offset : offset + nbytes]
