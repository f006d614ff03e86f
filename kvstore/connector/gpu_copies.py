"""Same-host copies on a CUDA host: one layer's pages of many stored blocks moved between GPU memory
(vLLM's paged KV) and a worker's mapped DRAM arena by the GPU itself. The arena's mapping is
registered with CUDA once (page-locked, and mapped into the GPU's address space); a layer then
moves as one gather (a load: arena -> pages) or one scatter (a save: pages -> arena) on a side
stream, the GPU reading or writing host memory directly, and an event says when it is done.

    copy = gpu_copy_layer(op, pages, start, end, cache, arena, after)  # on a side stream; None: NIXL
    copy.poll() / copy.wait(timeout_s) -> "pending" | "done" | "failed"  # as NIXL's transfers
    copy.settle()                                                        # until the GPU is done

Bytes [start, end) of each block (its `runs` in the arena, (addr, len) in the worker's address
space) go to or come from GPU memory at `addr` (within `cache`'s allocation). Both sides are cut
into rows of the largest size that divides every piece and offset (a layer's page, or a tier page
where a block spans several), and the rows are gathered or scattered by index: one kernel a layer,
whatever the number of blocks. A load's checksums stay on the host: its blocks are hashed in the
arena beside the copy (`page_checksums.ArenaHashes`); a save hashes its own pages
(`page_checksums.saved_checksums`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref

import numpy as np
import torch

from kvstore.connector.arenas import Arena
from kvstore.connector.layer_copies import POLL_S, pieces

log = logging.getLogger(__name__)
_streams: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per GPU for the copies
CHUNK_BYTES = 32 << 20  # a layer's rows move in chunks of this many bytes (each one temporary on the GPU)
PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every GPU of the process
MIN_ROW_BYTES = 256  # pieces cut finer than this go over NIXL (an index per few bytes costs more than it moves)


class GpuCopy:
    """A copy queued on a CUDA stream: what a NIXL `Transfer` answers. It keeps what it copies with
    (the arena's mapping, the index tensors) alive until the GPU is done with them."""

    def __init__(self, event: torch.cuda.Event, keep: tuple) -> None:
        self._event, self._keep = event, keep
        self.error: str | None = None

    def poll(self) -> str:
        return "done" if self._event.query() else "pending"

    def wait(self, timeout_s: float | None = None) -> str:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._event.query():
            if deadline is not None and time.monotonic() > deadline:
                return "pending"
            time.sleep(POLL_S)
        return "done"

    def settle(self) -> None:
        self._event.synchronize()


def gpu_copy_layer(op: str, pages: list[tuple[int, list[tuple[int, int]]]], start: int, end: int,
                   cache: torch.Tensor, arena: Arena, after: torch.cuda.Event | None = None) -> GpuCopy | None:
    """`op` "WRITE" copies GPU -> arena, "READ" arena -> GPU, once `after` (an event of the engine's
    stream) has passed; None where this cannot (the arena could not be registered with CUDA, a piece
    outside either side, pieces cut too fine): NIXL carries it."""
    there = registered(arena, cache.device)
    if there is None:
        return None
    here = _storage_bytes(cache)
    here_at, there_at, n = pieces(pages, start, end)
    here_at -= here.data_ptr()
    there_at -= arena.base_addr
    planned = plan_rows(here_at, there_at, n, here.numel(), there.numel())
    if planned is None:
        return None
    row, here_idx, there_idx = planned
    stream = _streams.get(cache.device) or _streams.setdefault(cache.device, torch.cuda.Stream(cache.device))
    try:
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            here_idx = torch.from_numpy(here_idx).pin_memory().to(cache.device, non_blocking=True)
            there_idx = torch.from_numpy(there_idx).pin_memory().to(cache.device, non_blocking=True)
            move_rows(op, here, there, row, here_idx, there_idx)
            event = torch.cuda.Event()
            event.record(stream)
    except RuntimeError as exc:  # refused at launch (nothing was copied): NIXL carries it
        log.warning("a GPU copy with agent %s's arena failed to start (%s): NIXL carries it", arena.agent_name, exc)
        return None
    return GpuCopy(event, (arena, here_idx, there_idx))


def plan_rows(here_at: np.ndarray, there_at: np.ndarray, n: np.ndarray, here_size: int, there_size: int
              ) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(row bytes, row indices here, row indices there) moving pieces (offset here, offset there,
    bytes); None if a piece lies outside either side or the rows would be under MIN_ROW_BYTES."""
    if not len(n):
        return None
    if here_at.min() < 0 or there_at.min() < 0 or (here_at + n).max() > here_size or (there_at + n).max() > there_size:
        return None
    row = math.gcd(*np.concatenate([n, here_at, there_at]).tolist())  # gcd(0, x) = x: offset 0 is fine
    if row < MIN_ROW_BYTES:
        return None
    counts = n // row
    steps = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return row, np.repeat(here_at // row, counts) + steps, np.repeat(there_at // row, counts) + steps


def move_rows(op: str, here: torch.Tensor, there: torch.Tensor, row: int, here_idx: torch.Tensor,
              there_idx: torch.Tensor) -> None:
    """Rows of `row` bytes of two flat byte tensors: "WRITE" here -> there, "READ" there -> here."""
    word = torch.int64 if row % 8 == 0 else torch.uint8  # wider elements: fewer loads and stores a row
    here_rows, there_rows = (_as_rows(t, row, word) for t in (here, there))
    step = max(1, CHUNK_BYTES // row)  # the gathered rows are a temporary of at most CHUNK_BYTES
    for first in range(0, len(here_idx), step):
        mine, theirs = here_idx[first:first + step], there_idx[first:first + step]
        if op == "WRITE":
            there_rows.index_copy_(0, theirs, here_rows.index_select(0, mine))
        else:
            here_rows.index_copy_(0, mine, there_rows.index_select(0, theirs))


def _as_rows(flat: torch.Tensor, row: int, word: torch.dtype) -> torch.Tensor:
    usable = flat.numel() // row * row
    return flat[:usable].view(word).view(usable // row, -1)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation behind `t` (vLLM backs all layers with one), as a flat tensor."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))


class _CudaView:
    """Host memory registered with CUDA, described for `torch.as_tensor` (the CUDA array interface)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


_lock = threading.Lock()  # one registration at a time: the saver and the layer poller may both ask
_views: "weakref.WeakKeyDictionary[Arena, dict[int, torch.Tensor | None]]" = weakref.WeakKeyDictionary()


def registered(arena: Arena, device: torch.device) -> torch.Tensor | None:
    """The arena's mapping as a CUDA byte tensor on `device` (registered once; unregistered when
    the mapping goes), or None if CUDA refuses it (logged once per arena and device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        views = _views.setdefault(arena, {})
        if index not in views:
            pinned = any(view is not None for view in views.values())  # for another GPU: registered already
            done: list = []  # on a thread of its own: a CUDA error it leaves is that thread's, not the forward's
            thread = threading.Thread(target=lambda: done.append(_register(arena, index, pinned)),
                                      name="kvstore-cuda-register")
            thread.start()
            thread.join()
            views[index] = done[0] if done else None
        return views[index]


def _register(arena: Arena, device: int, pinned: bool) -> torch.Tensor | None:
    addr, nbytes = arena.array.ctypes.data, arena.array.nbytes
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        if not pinned and int(cudart.cudaHostRegister(addr, nbytes, PORTABLE)) != 0:
            log.warning("CUDA refused to register the mapped arena of agent %s (%d bytes): NIXL carries its blocks",
                        arena.agent_name, nbytes)
            return None
        try:
            view = torch.as_tensor(_CudaView(addr, nbytes), device=device)
            if (view.data_ptr(), view.device.index) != (addr, device):  # torch copied it instead of aliasing it
                raise RuntimeError(f"the arena is not addressable in place from GPU {device}")
        except (RuntimeError, TypeError) as exc:
            log.warning("GPU %d cannot address the mapped arena of agent %s (%s): NIXL carries its blocks",
                        device, arena.agent_name, exc)
            if not pinned:
                cudart.cudaHostUnregister(addr)
            return None
    if not pinned:
        weakref.finalize(arena, cudart.cudaHostUnregister, addr)  # before the mapping goes with the arena
    return view
