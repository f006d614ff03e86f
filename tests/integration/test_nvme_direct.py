"""NVMe slabs opened with O_DIRECT, moved through NIXL POSIX: blocks whose size is not a whole
number of sectors go down and come back byte-exact without touching their neighbours' pages; a
filesystem that refuses O_DIRECT is fallen back from with `auto` and refused with `on`."""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.core import moving, specs
from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent
from kvstore.worker.mover import Mover
from kvstore.worker.nvme import NvmeTier
from kvstore.worker.settings import WorkerSettings

PAGE = 16 << 10
SIZES = [2 * PAGE + 100, PAGE - 4000, 3 * PAGE]  # the first two end mid-sector


def takes_direct(folder: Path) -> bool:
    probe = folder / f"probe-{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    finally:
        probe.unlink(missing_ok=True)


def round_trip(folder: Path, direct: str, corrupt: int | None = None) -> NvmeTier:
    """Three blocks DRAM -> NVMe -> other DRAM pages, each between neighbours that must not change;
    block `corrupt` is damaged on NVMe in between and must fail its promotion alone. The promotion
    reads in more than one request, the checksums of each beside the next one's read."""
    arena = HostBuffer(32 * PAGE)
    arena.array[:] = np.random.default_rng(1).integers(0, 256, arena.nbytes, dtype=np.uint8)
    nvme = NvmeTier(folder, 32 * PAGE, PAGE, direct=direct)
    agent = Agent(f"direct-{uuid.uuid4().hex[:8]}", {"POSIX": {"use_aio": "true"}}, progress_thread=False)
    try:
        agent.register_dram(arena.addr, arena.nbytes)
        nvme.register(agent)
        mover = Mover(agent, arena, PAGE, nvme=nvme, s3=None, bounce_bytes=1 << 20)
        down, first = [], 0
        for k, nbytes in enumerate(SIZES):
            pages = -(-nbytes // PAGE)
            nvme_runs = [specs.PageRun(first=first + 1, count=pages)]  # a page between neighbours
            assert nvme.allocator.reserve("move-1-ab", nvme_runs)
            down.append(moving.MoveItem(
                src_kind="dram", src_runs=[specs.PageRun(first=first, count=pages)], dst_kind="nvme",
                dst_runs=nvme_runs, dst_token="move-1-ab", nbytes=nbytes,
                checksum=xxhash.xxh3_64(arena.view(first * PAGE, nbytes)).hexdigest(), namespace_id="0" * 16,
                hash=f"{k:032x}"))
            first += pages + 1
        assert mover.move(moving.MoveRequest(items=down)).codes == ["ok"] * len(SIZES)
        if corrupt is not None:
            last = down[corrupt].dst_runs[0].first * PAGE + down[corrupt].nbytes - 1  # its last byte
            with open(folder / "slab-0000.bin", "r+b") as slab:
                slab.seek(last)
                flipped = bytes([slab.read(1)[0] ^ 0xFF])
                slab.seek(last)
                slab.write(flipped)
        submit, reads = agent.submit, []
        agent.submit = lambda op, *args: (reads.append(op), submit(op, *args))[1]

        sentinel = 0x5A
        arena.array[16 * PAGE:] = sentinel  # promotion lands in pages 16.. with a gap page after each
        up, first = [], 16
        for item in down:
            pages = -(-item.nbytes // PAGE)
            up.append(item.model_copy(update=dict(src_kind="nvme", src_runs=item.dst_runs, dst_kind="dram",
                                                  dst_runs=[specs.PageRun(first=first, count=pages)])))
            first += pages + 1
        assert mover.move(moving.MoveRequest(items=up)).codes == [
            "source_corrupt" if k == corrupt else "ok" for k in range(len(SIZES))]
        assert reads.count("READ") > 1
        for k, (before, after) in enumerate(zip(down, up)):
            src, dst = before.src_runs[0].first * PAGE, after.dst_runs[0].first * PAGE
            assert (bytes(arena.view(dst, before.nbytes)) == bytes(arena.view(src, before.nbytes))) != (k == corrupt)
            gap = (after.dst_runs[0].first + after.dst_runs[0].count) * PAGE
            assert (arena.view(gap, PAGE) == sentinel).all()  # the page after it was not written
        return nvme
    finally:
        agent.close()


def test_blocks_of_any_size_go_down_and_back_through_o_direct_slabs(tmp_path):
    nvme = round_trip(tmp_path, "auto")
    expect = takes_direct(tmp_path)
    assert bool(nvme.direct) == expect
    assert all(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT) == expect for fd in nvme.fds)
    nvme.close()
    survivors = NvmeTier(tmp_path, 32 * PAGE, PAGE, direct="auto").survivors()
    assert sorted((s.hash, s.nbytes) for s in survivors) == [(f"{k:032x}", n) for k, n in enumerate(SIZES)]


def test_a_block_damaged_on_nvme_fails_its_promotion_alone(tmp_path):
    round_trip(tmp_path, "auto", corrupt=1).close()


def test_the_page_cache_path_still_moves_the_same_bytes(tmp_path):
    nvme = round_trip(tmp_path, "off")
    assert nvme.direct is None and not any(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in nvme.fds)
    nvme.close()


def test_a_filesystem_without_o_direct_is_fallen_back_from_or_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):  # as tmpfs before Linux 6.6, and some network filesystems
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(KVStoreError, match="refuses O_DIRECT"):
        NvmeTier(tmp_path / "on", 32 * PAGE, PAGE, direct="on")
    nvme = round_trip(tmp_path / "auto", "auto")
    assert nvme.direct is None and not any(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in nvme.fds)
    nvme.close()


def test_o_direct_on_needs_pages_in_whole_sectors(tmp_path):
    with pytest.raises(KVStoreError, match="multiples of 4096"):
        NvmeTier(tmp_path, 32 * 5000, 5000, direct="on")
    assert NvmeTier(tmp_path / "auto", 32 * 5000, 5000, direct="auto").direct is None
    with pytest.raises(ValueError, match="nvme_direct on needs page_bytes in multiples of 4096"):
        WorkerSettings(page_bytes=5000, nvme_direct="on")
