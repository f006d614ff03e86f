"""A batch of DRAM -> NVMe moves, its sources hashed beside the write: a bad source is written to
pages the directory gives back and is never recorded; the good ones are. The file I/O is the
test's own, behind NIXL's submit interface."""

from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from kvstore.core import moving, specs
from kvstore.core.memory import HostBuffer
from kvstore.worker.mover import Mover
from kvstore.worker.nvme import NvmeTier

PAGE = 4096


class Done:
    abandoned = False
    error = None

    def wait(self, timeout_s: float) -> str:
        return "done"


class FileAgent:
    """Writes (address, length) DRAM rows to (offset, length, fd) file rows with pwrite, as NIXL
    POSIX would; records the thread each request was served on."""

    name = "w0"

    def __init__(self, arena: HostBuffer) -> None:
        self.arena = arena
        self.threads: list[int] = []

    def submit(self, op, local, remote, peer, local_mem, remote_mem) -> Done:
        assert (op, local_mem, remote_mem) == ("WRITE", "DRAM", "FILE")
        self.threads.append(threading.get_ident())
        for (addr, length), (offset, _, fd) in zip(local.tolist(), remote.tolist()):
            os.pwrite(fd, self.arena.view(addr - self.arena.addr, length), offset)
        return Done()


def test_a_bad_source_in_a_batch_to_nvme_is_reported_and_never_recorded(tmp_path):
    arena = HostBuffer(8 * PAGE)
    arena.array[:] = np.random.default_rng(0).integers(0, 256, arena.nbytes, dtype=np.uint8)
    nvme = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    agent = FileAgent(arena)
    mover = Mover(agent, arena, PAGE, nvme=nvme, s3=None, bounce_bytes=0)
    items = []
    for k in range(3):
        nvme.allocator.reserve("move-1-ab", [specs.PageRun(first=4 * k, count=2)])
        checksum = xxhash.xxh3_64(arena.view(2 * k * PAGE, 2 * PAGE)).hexdigest()
        items.append(moving.MoveItem(src_kind="dram", src_runs=[specs.PageRun(first=2 * k, count=2)],
                                     dst_kind="nvme", dst_runs=[specs.PageRun(first=4 * k, count=2)],
                                     dst_token="move-1-ab", nbytes=2 * PAGE, checksum=checksum,
                                     namespace_id="0" * 16, hash=f"{k:032x}"))
    arena.array[2 * PAGE + 5] ^= 0xFF  # block 1's source no longer matches its checksum

    result = mover.move(moving.MoveRequest(items=items))

    assert result.codes == ["ok", "source_corrupt", "ok"]
    assert "before demotion" in result.errors[1]
    assert agent.threads == [threading.get_ident()]  # one request for the batch
    for k in (0, 2):  # the good blocks' bytes are in the slab where their pages are
        written = os.pread(nvme.fds[0], 2 * PAGE, 4 * k * PAGE)
        assert written == bytes(arena.view(2 * k * PAGE, 2 * PAGE))
    nvme.close()
    survivors = NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors()
    assert sorted(s.hash for s in survivors) == [f"{0:032x}", f"{2:032x}"]  # the bad one never recorded
