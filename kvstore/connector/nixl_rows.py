"""NIXL descriptor rows of the connector's transfers: blocks between an engine's memory and a
storage worker's tier, whole or one layer at a time.

    by_tier(locations) -> {(worker, epoch, tier): [index, ...]}   # one NIXL request (or arena) each
    local, remote = rows([(buffer, location), ...])               # whole blocks
    local, remote = slice_rows([(addr, runs), ...], start, end)   # bytes [start, end) of each block
    remote, mem = remote_side(remote, location)                   # an HBM tier's rows carry its GPU
"""

from __future__ import annotations

import numpy as np

from kvstore.core import specs


def by_tier(locations: list[specs.ReplicaLocation]) -> dict[tuple[str, int, str], list[int]]:
    """The indices of `locations` per storage worker (name, epoch) and tier: one memory type, one
    NIXL request or arena each."""
    groups: dict[tuple[str, int, str], list[int]] = {}
    for k, location in enumerate(locations):
        groups.setdefault((location.worker, location.epoch, location.tier), []).append(k)
    return groups


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


def slice_rows(blocks: list[tuple[int, list[tuple[int, int]]]], start: int, end: int,
               device: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptors moving bytes [start, end) of stored blocks: for each block, the
    local address that byte `start` goes to, and the (addr, len) runs the block lives in remotely
    (split where the runs are). With `device` (a GPU's index) local rows are (addr, len, device)."""
    local, remote = [], []
    for dest, runs in blocks:
        offset = 0  # position within the block of the current run
        for run_addr, run_len in runs:
            lo, hi = max(start, offset), min(end, offset + run_len)
            if lo < hi:
                local.append((dest + lo - start, hi - lo))
                remote.append((run_addr + lo - offset, hi - lo))
            offset += run_len
    local_rows = np.array(local, dtype=np.uint64).reshape(-1, 2)
    return local_rows if device is None else on_device(local_rows, device), np.array(remote, dtype=np.uint64)
