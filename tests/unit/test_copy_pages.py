"""copy_pages and CopyHashes: a layer's pages copied between this process's registered memory and
a mapped arena, each block hashed as its pages are copied (the vLLM connector's same-host path)."""

from __future__ import annotations

import mmap

import numpy as np
import torch
import xxhash

from kvstore.connector.copies import HostMemory, _Arena, copy_pages
from kvstore.connector.page_checksums import CopyHashes, block_checksums, checksums

BASE = 1 << 40  # the arena's address in the worker's process: unrelated to where it is mapped here


def arena(nbytes: int) -> _Arena:
    mapping = mmap.mmap(-1, nbytes)
    return _Arena("agent", 1, BASE, np.frombuffer(mapping, dtype=np.uint8), mapping)


def test_a_layer_of_blocks_split_over_runs_is_written_and_read_back_where_the_runs_are():
    pages = (np.arange(4096, dtype=np.uint32) % 251).astype(np.uint8).reshape(4, 1024)  # 2 layers x 2 blocks
    memory, there = HostMemory(), arena(8192)
    addr = int(pages.ctypes.data)
    memory.add(addr, pages.nbytes)
    runs = [[(BASE + 4096, 1536), (BASE + 512, 512)], [(BASE + 6000, 2048)]]  # block 0 in two runs
    for layer in (0, 1):  # layer l of block b is pages[2l + b]: bytes [1024 l, 1024 (l+1)) of the block
        blocks = [(addr + (2 * layer + b) * 1024, runs[b], None) for b in (0, 1)]
        assert copy_pages("WRITE", blocks, 1024 * layer, 1024 * (layer + 1), memory, there).wait() == "done"
    stored0 = np.concatenate([there.array[4096:5632], there.array[512:1024]])
    assert (stored0 == np.concatenate([pages[0], pages[2]])).all()
    assert (there.array[6000:8048] == np.concatenate([pages[1], pages[3]])).all()
    back = np.zeros_like(pages)
    memory.add(int(back.ctypes.data), back.nbytes)
    got = copy_pages("READ", [(int(back.ctypes.data), runs[0], None)], 1024, 2048, memory, there)
    assert got.poll() == "done" and (back[0] == pages[2]).all() and not back[1:].any()


def test_a_page_outside_the_arena_or_the_registered_memory_fails():
    pages = np.ones(2048, dtype=np.uint8)
    memory, there = HostMemory(), arena(4096)
    addr = int(pages.ctypes.data)
    memory.add(addr, pages.nbytes)
    beyond = copy_pages("WRITE", [(addr, [(BASE + 4000, 1024)], None)], 0, 1024, memory, there)
    assert (beyond.state, bool(there.array.any())) == ("failed", False)
    unregistered = copy_pages("WRITE", [(addr + 1536, [(BASE, 1024)], None)], 0, 1024, memory, there)
    assert unregistered.state == "failed" and "outside" in unregistered.error
    assert copy_pages("READ", [(addr, [(BASE - 16, 16)], None)], 0, 16, memory, there).state == "failed"


def test_blocks_hashed_as_their_pages_are_copied_match_the_checksum_of_their_pages():
    layers, blocks = 3, 4
    caches = {f"l{i}": torch.randint(0, 255, (blocks, 2, 8, 16), dtype=torch.uint8) for i in range(layers)}
    names = list(caches)
    memory, there = HostMemory(), arena(1 << 16)
    for t in caches.values():
        memory.add(t.data_ptr(), t.nbytes)
    page = caches["l0"][0].nbytes
    hashes = CopyHashes([0, 1, 2], layers)  # block 3 is never copied; block 2 goes over NIXL at layer 1
    for layer, name in enumerate(names):
        copied = [(caches[name][b].data_ptr(), [(BASE + b * layers * page, layers * page)],
                   hashes.for_layer(b, layer)) for b in ((0, 1) if layer == 1 else (0, 1, 2))]
        if layer == 1:
            hashes.spoil([2])
        assert copy_pages("WRITE", copied, layer * page, (layer + 1) * page, memory, there).state == "done"
    expected = block_checksums(caches, names, [0, 1, 2, 3])
    assert [hashes.hexdigest(b) for b in (0, 1, 2, 3)] == expected[:2] + [None, None]
    assert checksums(caches, names, [0, 1, 2, 3], hashes) == expected  # the missing ones taken from the pages
    stored = there.array[:layers * page].tobytes()  # what block 0's arena holds is what was hashed
    assert xxhash.xxh3_64_hexdigest(stored) == expected[0]


def test_a_layer_hashed_out_of_order_or_twice_leaves_the_block_without_a_checksum():
    hashes = CopyHashes([5, 6], 2)
    assert hashes.for_layer(5, 1) is None and hashes.for_layer(5, 0) is None  # layer 1 before layer 0
    assert hashes.for_layer(6, 0) is not None and hashes.for_layer(6, 0) is None  # a block id twice in a layer
    assert hashes.for_layer(6, 1) is None and hashes.hexdigest(5) is None and hashes.hexdigest(6) is None
