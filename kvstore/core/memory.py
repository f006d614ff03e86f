"""Page-aligned host buffers (anonymous mmap), usable by numpy, torch and NIXL."""

from __future__ import annotations

import mmap

import numpy as np


class HostBuffer:
    """`nbytes` of zero-filled, page-aligned host memory at a stable address."""

    def __init__(self, nbytes: int) -> None:
        assert nbytes > 0, "a buffer needs a positive size"
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        assert 0 <= offset and offset + nbytes <= self.nbytes, "view outside the buffer"
        return self.array[offset : offset + nbytes]
