"""A layer's pages copied between this process's registered memory and a mapped arena: copy_pages
(page by page, each hashed as it is copied: SGLang's path) and copy_layer (strided batches on the
copy threads: the vLLM connector's and layer-wise loads' path), and ArenaHashes (blocks hashed in
the arena, where each is contiguous)."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch
import xxhash

from kvstore.connector import layer_copies
from kvstore.connector.arenas import Arena, arena_digest
from kvstore.connector.copies import BlockCopier, reindexed
from kvstore.connector.nixl_rows import remote_side
from kvstore.connector.layer_copies import HostMemory, copy_layer, copy_pages
from kvstore.connector.page_checksums import ArenaHashes, block_checksums, checksums
from kvstore.core import specs

BASE = 1 << 40  # the arena's address in the worker's process: unrelated to where it is mapped here


def arena(nbytes: int) -> Arena:
    mapping = mmap.mmap(-1, nbytes)
    return Arena("agent", 1, BASE, np.frombuffer(mapping, dtype=np.uint8), mapping)


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


def test_a_layer_copied_in_strided_batches_on_the_pool_lands_where_a_page_by_page_copy_puts_it():
    """Blocks 0-5 contiguous in the arena (one batch per layer), 6 split over two runs and 7 at
    an odd place; pages of blocks 0-3 consecutive here, 4-7 scattered: written layer by layer
    on two threads (INLINE_BYTES lowered so the pool is used), then read back the same way."""
    layers, page = 3, 4096
    memory, there = HostMemory(), arena(1 << 20)
    pages = np.random.default_rng(7).integers(0, 255, (layers, 16, page), dtype=np.uint8)
    back = np.zeros_like(pages)
    for buffer in (pages, back):
        memory.add(int(buffer.ctypes.data), buffer.nbytes)
    block = layers * page
    runs = {b: [(BASE + b * block, block)] for b in range(6)}
    runs[6] = [(BASE + 6 * block, page + 100), (BASE + 100 * page, block - page - 100)]
    runs[7] = [(BASE + 200 * page + 8, block)]
    slots = [0, 1, 2, 3, 9, 5, 15, 11]  # where block b's pages are here
    with ThreadPoolExecutor(2) as pool:
        layer_copies.INLINE_BYTES, inline = 0, layer_copies.INLINE_BYTES
        try:
            for op, buffer in (("WRITE", pages), ("READ", back)):
                for layer in range(layers):
                    rows = [(int(buffer[layer, slots[b]].ctypes.data), runs[b]) for b in range(8)]
                    copy = copy_layer(op, rows, layer * page, (layer + 1) * page, memory, there, pool)
                    assert copy.wait(5) == "done" and copy.error is None
        finally:
            layer_copies.INLINE_BYTES = inline
    for b in range(8):
        stored = np.concatenate([there.array[a - BASE:a - BASE + n] for a, n in runs[b]])
        assert (stored == pages[:, slots[b]].reshape(-1)).all()
        assert arena_digest(there, runs[b]) == xxhash.xxh3_64_hexdigest(pages[:, slots[b]].tobytes())
    assert (back[:, slots] == pages[:, slots]).all() and not np.delete(back, slots, axis=1).any()


def test_a_layer_copy_with_a_page_outside_the_arena_or_the_registered_memory_copies_nothing():
    pages = np.ones((4, 1024), dtype=np.uint8)
    memory, there = HostMemory(), arena(4096)
    memory.add(int(pages.ctypes.data), pages.nbytes)
    rows = [(int(pages[k].ctypes.data), [(BASE + 1024 * k, 1024)]) for k in range(4)]
    with ThreadPoolExecutor(2) as pool:
        beyond = copy_layer("WRITE", rows[:3] + [(rows[3][0], [(BASE + 3584, 1024)])], 0, 1024, memory, there, pool)
        unregistered = copy_layer("WRITE", rows[:3] + [(rows[3][0] + 512, rows[3][1])], 0, 1024, memory, there, pool)
        below = copy_layer("READ", [(rows[0][0], [(BASE - 16, 1024)])], 0, 1024, memory, there, pool)
    assert (beyond.poll(), unregistered.poll(), below.poll()) == ("failed",) * 3
    assert "outside the mapped arena" in beyond.error and "registered memory" in unregistered.error
    assert not there.array.any()


def test_a_copier_planned_at_the_first_layer_moves_every_layer_as_a_plan_per_layer_does():
    """LayerCopier plans once for blocks that are one run each (the shifted plan must put every
    layer where copy_layer's own plan does), plans per layer for a block in two runs, and still
    refuses a layer whose shifted pieces leave the arena, copying nothing of it."""
    layers, page, slots = 4, 2048, [3, 0, 1, 2, 7, 6]
    block = layers * page
    pages = np.random.default_rng(11).integers(0, 255, (layers, 8, page), dtype=np.uint8)  # [layer, slot, page]
    memory = HostMemory()
    back = {name: np.zeros_like(pages) for name in ("planned", "per layer")}
    for buffer in (pages, *back.values()):
        memory.add(int(buffer.ctypes.data), buffer.nbytes)
    whole = [[(BASE + 5 * block + k * block, block)] for k in range(6)]  # in the arena 5 blocks in, in order
    split = whole[:5] + [[(BASE, page + 8), (BASE + 64 * block, block - page - 8)]]
    step = pages.strides[1]
    with ThreadPoolExecutor(2) as pool:
        layer_copies.INLINE_BYTES, inline = 0, layer_copies.INLINE_BYTES
        try:
            for runs in (whole, split):
                arenas = {name: arena(128 * block) for name in back}
                copier = layer_copies.LayerCopier(slots, runs)
                for op in ("WRITE", "READ"):
                    for layer in range(layers):
                        start, end = layer * page, (layer + 1) * page
                        source = pages if op == "WRITE" else back["planned"]
                        planned = copier.copy(op, int(source[layer].ctypes.data), step, start, end, memory,
                                              arenas["planned"], pool)
                        source = pages if op == "WRITE" else back["per layer"]
                        rows = [(int(source[layer, s].ctypes.data), r) for s, r in zip(slots, runs)]
                        alone = copy_layer(op, rows, start, end, memory, arenas["per layer"], pool)
                        assert planned.wait(5) == alone.wait(5) == "done"
                assert (arenas["planned"].array == arenas["per layer"].array).all()
                assert (back["planned"] == back["per layer"]).all()
                assert (back["planned"][:, slots] == pages[:, slots]).all()
                assert len(copier._plans) == (1 if runs is whole else 0)
        finally:
            layer_copies.INLINE_BYTES = inline
        near_end = arena(6 * block + page // 2)  # the last layer of block 5 ends past the end
        copier = layer_copies.LayerCopier(slots, [[(BASE + k * block + page, block)] for k in range(6)])
        states = [copier.copy("WRITE", int(pages[layer].ctypes.data), step, layer * page, (layer + 1) * page,
                              memory, near_end, pool).wait(5) for layer in range(layers)]
    assert states == ["done", "done", "done", "failed"]
    assert not any(near_end.array[(4 * k + 4) * page:(4 * k + 5) * page].any() for k in range(6))  # layer 3
    assert near_end.array[(4 * 5 + 3) * page:(4 * 5 + 4) * page].any()  # layer 2 of block 5


def test_batches_cover_every_piece_once_at_steps_that_never_overlap():
    rng = np.random.default_rng(3)
    for _ in range(500):
        sizes = rng.choice([4, 4, 4, 8], rng.integers(0, 12))
        here = 1000 + np.cumsum([rng.choice([n, n, 2 * n, -n, 0, 3]) for n in sizes]).astype(np.int64)
        at = 5000 + np.cumsum([rng.choice([n, n, 16, -8, 0]) for n in sizes]).astype(np.int64)
        pieces = list(zip(here.tolist(), at.tolist(), sizes.tolist()))
        batches = layer_copies._batches(here, at, sizes.astype(np.int64))
        assert all(count == 1 or min(step_here, step_there) >= n for _, _, n, count, step_here, step_there in batches)
        for threads in (1, 2, 3):
            shares = layer_copies._shares(batches, threads)
            assert [(h + k * sh, a + k * st, n) for share in shares for h, a, n, count, sh, st in share
                    for k in range(count)] == pieces
    steady = np.arange(256, dtype=np.int64)
    assert len(layer_copies._batches(1000 + 64 * steady, 1024 * steady, np.full(256, 64))) == 1


def test_blocks_hashed_in_the_arena_match_the_checksum_of_their_pages():
    layers, blocks = 3, 4
    caches = {f"l{i}": torch.randint(0, 255, (blocks, 2, 8, 16), dtype=torch.uint8) for i in range(layers)}
    names = list(caches)
    memory, there = HostMemory(), arena(1 << 16)
    for t in caches.values():
        memory.add(t.data_ptr(), t.nbytes)
    page = caches["l0"][0].nbytes
    runs = {b: [(BASE + b * layers * page, layers * page)] for b in range(blocks)}
    hashes = ArenaHashes([0, 1, 2], layers)  # block 3 is never copied; block 2 goes over NIXL at layer 1
    with ThreadPoolExecutor(2) as pool:
        for layer, name in enumerate(names):
            copied = [(b, runs[b]) for b in ((0, 1) if layer == 1 else (0, 1, 2))]
            if layer == 1:
                hashes.spoil([2])
            hashes.copied(copied, layer, there)
            rows = [(caches[name][b].data_ptr(), r) for b, r in copied]
            assert copy_layer("WRITE", rows, layer * page, (layer + 1) * page, memory, there, pool).wait(5) == "done"
        hashes.hash([0, 1, 2, 3], pool)
        expected = block_checksums(caches, names, [0, 1, 2, 3])
        assert [hashes.hexdigest(b) for b in (0, 1, 2, 3)] == expected[:2] + [None, None]
        assert checksums(caches, names, [0, 1, 2, 3], hashes) == expected  # the missing ones taken from the pages
    there.array[5] ^= 1  # a byte of block 0 changed in the arena: its checksum there changes
    assert ArenaHashes([0], 1).hexdigest(0) is None and arena_digest(there, runs[0]) != expected[0]


def test_a_layer_out_of_order_twice_or_from_another_arena_leaves_the_block_without_a_checksum():
    one, other = arena(4096), arena(4096)
    hashes = ArenaHashes([5, 6, 7], 2)
    hashes.copied([(5, [(BASE, 64)])], 1, one)  # layer 1 before layer 0
    hashes.copied([(6, [(BASE, 64)]), (6, [(BASE, 64)])], 0, one)  # a block id twice in a layer
    hashes.copied([(7, [(BASE, 64)])], 0, one)
    hashes.copied([(7, [(BASE, 64)])], 1, other)  # the worker restarted between the layers
    assert [hashes.hexdigest(b) for b in (5, 6, 7)] == [None, None, None]


class Arenas:
    """LocalArenas' view: the arena of each location's worker, None for a worker on another host."""

    def __init__(self, arenas: dict[str, Arena]) -> None:
        self.arenas = arenas

    def view(self, location):
        return self.arenas.get(location.worker)

    def close(self) -> None:
        pass


def test_blocks_read_in_place_go_through_the_unpack_copies_one_span_per_run_of_neighbours_and_hashed_there():
    """Blocks 0 and 1 follow each other in the arena (one span), 2 lies elsewhere in it, 3 is on
    another host (NIXL's), 4 is outside the arena mapped (failed, never copied)."""
    size, there = 1024, arena(1 << 16)
    there.array[:] = np.random.default_rng(5).integers(0, 255, there.array.size, dtype=np.uint8)
    where = {0: ("w0", 4096), 1: ("w0", 4096 + size), 2: ("w0", 20000), 3: ("far", 0), 4: ("w0", (1 << 16) - 512)}
    items = [(np.zeros(size, np.uint8), specs.ReplicaLocation(worker=w, agent_name="a", epoch=1, tier="dram",
                                                              runs=[(BASE + at, size)])) for w, at in where.values()]
    out, spans = np.zeros((5, size), np.uint8), []

    def unpack(k, raw):
        spans.append((k, raw.nbytes))
        return [partial(np.copyto, out[k:k + raw.nbytes // size], raw.reshape(-1, size))]

    copier = BlockCopier(None, None, Arenas({"w0": there}), 5.0)
    try:
        done, digests, far = copier.in_place(items, unpack)
        assert (done, far, spans) == ([True, True, True, False, False], [3], [(0, 2 * size), (2, size)])
        for k in (0, 1, 2):
            stored = there.array[where[k][1]:where[k][1] + size]
            assert (out[k] == stored).all() and digests[k] == xxhash.xxh3_64_hexdigest(stored)
        assert not any(buffer.any() for buffer, _ in items) and not out[3:].any()  # nothing staged
        staging = np.arange(4 * size, dtype=np.uint32).astype(np.uint8)  # what NIXL would have read
        spans.clear()
        copier.transform_buffers([(0, staging[:size]), (1, staging[size:2 * size]), (3, staging[3 * size:])], unpack)
        assert spans == [(0, 2 * size), (3, size)] and (out[[0, 1, 3]] == staging.reshape(4, size)[[0, 1, 3]]).all()
    finally:
        copier.close()


def test_a_save_hashes_what_it_meant_to_write_not_what_the_arena_holds_after_its_copy(monkeypatch):
    """Another writer (a stale reservation's, another engine's) overwrites each chunk right after
    it is copied into the arena: the checksum is still the source's, so the next load finds out."""
    size, there = 1024, arena(1 << 16)
    items = [(np.random.default_rng(k).integers(0, 255, size, dtype=np.uint8),
              specs.ReplicaLocation(worker="w0", agent_name="a", epoch=1, tier="dram", runs=[(BASE + 8192 * k, size)]))
             for k in (1, 2)]
    real = np.copyto

    def then_overwritten(destination, source, **kw):
        real(destination, source, **kw)
        if np.shares_memory(destination, there.array):
            destination[...] = 0x5A

    monkeypatch.setattr(np, "copyto", then_overwritten)
    copier = BlockCopier(None, None, Arenas({"w0": there}), 5.0)
    try:
        done, digests, far = copier.copy_local("WRITE", items)
    finally:
        copier.close()
    assert (done, far) == ([True, True], [])
    assert digests == [xxhash.xxh3_64_hexdigest(block.tobytes()) for block, _ in items]
    assert (there.array[8192:8192 + size] == 0x5A).all()  # what a load finds: it does not hash to that


def test_a_transform_over_items_apart_from_their_blocks_goes_block_by_block_where_they_do_not_follow():
    calls = []
    run = reindexed(lambda k, raw: calls.append((k, raw.nbytes)) or [], [0, 1, 3, 4], 16)
    run(0, np.zeros(32, np.uint8))  # items 0, 1: blocks 0, 1
    run(1, np.zeros(32, np.uint8))  # items 1, 2: blocks 1, 3
    assert calls == [(0, 32), (1, 16), (3, 16)]


def test_a_block_in_several_runs_of_a_mapped_arena_is_written_and_read_in_place_through_its_buffer():
    size, there = 1024, arena(1 << 16)
    runs = [(BASE + 30000, 300), (BASE + 10000, size - 300)]  # the block's two runs, out of order
    item = (np.zeros(size, np.uint8), specs.ReplicaLocation(worker="w0", agent_name="a", epoch=1, tier="dram",
                                                            runs=runs))
    source = np.random.default_rng(11).integers(0, 255, size, dtype=np.uint8)
    out = np.zeros(size, np.uint8)
    copier = BlockCopier(None, None, Arenas({"w0": there}), 5.0)
    try:
        item[0][:] = source
        done, digests, far = copier.copy_local("WRITE", [item])
        stored = np.concatenate([there.array[30000:30300], there.array[10000:10000 + size - 300]])
        assert (done, far) == ([True], []) and (stored == source).all()
        assert digests == [xxhash.xxh3_64_hexdigest(source.tobytes())]
        item[0][:] = 0
        done, digests, far = copier.in_place([item], lambda k, raw: [partial(np.copyto, out, raw)])
        assert (done, far) == ([True], []) and (out == source).all()
        assert digests == [xxhash.xxh3_64_hexdigest(source.tobytes())]
    finally:
        copier.close()


def test_an_hbm_replica_is_addressed_on_its_gpu_and_a_dram_one_in_host_memory():
    runs = np.array([(1 << 40, 4096), ((1 << 40) + 8192, 4096)], dtype=np.uint64)
    hbm = specs.ReplicaLocation(worker="w", epoch=1, agent_name="a", tier="hbm", runs=[], device=3)
    rows, mem = remote_side(runs, hbm)
    assert mem == "VRAM" and rows.tolist() == [[1 << 40, 4096, 3], [(1 << 40) + 8192, 4096, 3]]
    rows, mem = remote_side(runs, hbm.model_copy(update={"tier": "dram", "device": 0}))
    assert mem == "DRAM" and rows is runs


def test_a_device_is_written_only_when_it_is_not_0():
    """A directory or an engine from before the field refuses bodies with fields it does not know."""
    dram = specs.TierSpec(kind="dram", capacity_bytes=4096, page_bytes=4096)
    hbm = specs.TierSpec(kind="hbm", capacity_bytes=4096, page_bytes=4096, device=3)
    assert "device" not in dram.model_dump_json() and '"device":3' in hbm.model_dump_json()
    assert specs.TierSpec.model_validate_json(hbm.model_dump_json()).device == 3
    at = specs.ReplicaLocation(worker="w", epoch=1, agent_name="a", tier="hbm", runs=[(1, 2)])
    assert "device" not in at.model_dump() and at.model_copy(update={"device": 1}).model_dump()["device"] == 1
