"""copy_rows: NIXL-style descriptor rows carried out as plain copies between this process's
registered memory and a mapped arena (the vLLM connector's same-host path)."""

from __future__ import annotations

import mmap

import numpy as np

from kvstore.connector.copies import HostMemory, _Arena, copy_rows

BASE = 1 << 40  # the arena's address in the worker's process: unrelated to where it is mapped here


def arena(nbytes: int) -> _Arena:
    mapping = mmap.mmap(-1, nbytes)
    return _Arena("agent", 1, BASE, np.frombuffer(mapping, dtype=np.uint8), mapping)


def rows(pairs):
    return np.array(pairs, dtype=np.uint64)


def test_rows_are_written_and_read_back_at_their_offsets():
    pages = np.arange(4096, dtype=np.uint8).reshape(4, 1024) * 3
    memory, there = HostMemory(), arena(8192)
    addr = int(pages.ctypes.data)
    memory.add(addr, pages.nbytes)
    local = rows([(addr + 1024, 1024), (addr, 1024), (addr + 3072, 512)])
    remote = rows([(BASE + 4096, 1024), (BASE, 1024), (BASE + 7000, 512)])
    assert copy_rows("WRITE", local, remote, memory, there).wait() == "done"
    assert (there.array[4096:5120] == pages[1]).all() and (there.array[:1024] == pages[0]).all()
    assert (there.array[7000:7512] == pages[3][:512]).all() and not there.array[1024:4096].any()
    back = np.zeros_like(pages)
    memory.add(int(back.ctypes.data), back.nbytes)
    local = rows([(int(back.ctypes.data) + 2048, 1024), (int(back.ctypes.data), 1024)])
    assert copy_rows("READ", local, rows([(BASE, 1024), (BASE + 4096, 1024)]), memory, there).poll() == "done"
    assert (back[2] == pages[0]).all() and (back[0] == pages[1]).all() and not back[1].any()


def test_a_row_outside_the_arena_or_the_registered_memory_fails():
    pages = np.ones(2048, dtype=np.uint8)
    memory, there = HostMemory(), arena(4096)
    addr = int(pages.ctypes.data)
    memory.add(addr, pages.nbytes)
    beyond = copy_rows("WRITE", rows([(addr, 1024)]), rows([(BASE + 4000, 1024)]), memory, there)
    assert (beyond.state, bool(there.array.any())) == ("failed", False)
    unregistered = copy_rows("WRITE", rows([(addr + 1536, 1024)]), rows([(BASE, 1024)]), memory, there)
    assert unregistered.state == "failed" and "outside" in unregistered.error
    below = copy_rows("READ", rows([(addr, 16)]), rows([(BASE - 16, 16)]), memory, there)
    assert below.state == "failed"


def test_rows_that_continue_one_another_on_both_sides_are_one_copy(monkeypatch):
    pages = np.arange(3072, dtype=np.uint32).view(np.uint8)[:3072].copy()
    memory, there = HostMemory(), arena(8192)
    addr = int(pages.ctypes.data)
    memory.add(addr, pages.nbytes)
    copies = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src: (copies.append(dst.size), real(dst, src)))
    local = rows([(addr, 1024), (addr + 1024, 1024), (addr + 2048, 1024)])
    remote = rows([(BASE, 1024), (BASE + 1024, 1024), (BASE + 4096, 1024)])  # the third jumps in the arena
    assert copy_rows("WRITE", local, remote, memory, there).state == "done"
    assert copies == [2048, 1024]
    assert (there.array[:2048] == pages[:2048]).all() and (there.array[4096:5120] == pages[2048:]).all()
