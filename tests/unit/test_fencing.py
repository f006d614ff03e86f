"""A worker's move fence: a token is settled only when nothing may write under it any more."""

from __future__ import annotations

import numpy as np
import xxhash

from kvstore.core import moving, specs
from kvstore.core.memory import HostBuffer
from kvstore.worker.fencing import KEEP_S, MoveFence
from kvstore.worker.mover import Mover

PAGE = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Posted:
    """A NIXL request that timed out while posted; `done` once NIXL has finished with it."""

    def __init__(self) -> None:
        self.done = False

    def settled(self) -> bool:
        return self.done


def test_running_stuck_and_fenced_tokens():
    clock = Clock()
    fence = MoveFence(clock)
    assert fence.begin({"a"}) and fence.begin({"a", "b"})  # one token may serve two requests
    fence.end({"a"})
    assert fence.fence(["a", "b", "c"]) == [False, False, True]  # "a" still has a request running
    fence.end({"a", "b"})
    assert fence.fence(["a", "b"]) == [True, True]
    assert not fence.begin({"a"}) and not fence.begin({"c", "d"})  # fenced: never starts
    assert fence.begin({"d"})
    posted = Posted()
    fence.stuck({"d"}, posted)
    fence.end({"d"})
    assert fence.fence(["d"]) == [False] and not fence.quiesce(0.1)  # its NIXL request may still write
    clock.now = KEEP_S + 1  # past every move's deadline: fenced tokens are forgotten, a stuck one is not
    assert fence.fence(["d", "e"]) == [False, True]
    posted.done = True  # NIXL has finished with it
    assert fence.quiesce(0.1) and fence.fence(["d"]) == [True]
    assert fence.begin({"a"}) and fence.fence(["a"]) == [False]  # "a" was forgotten: it may run again


class NeverDone:
    """A posted NIXL request that does not finish within the move's wait, nor after."""

    abandoned = False
    error = None

    def wait(self, timeout_s: float) -> str:
        self.abandoned, self.error = True, f"timed out after {timeout_s}s"
        return "failed"

    def settled(self) -> bool:
        return False


class StuckAgent:
    name = "w0"

    def add_peer(self, metadata: bytes) -> str:
        return "w1"

    def submit(self, *args, **kwargs) -> NeverDone:
        return NeverDone()


def test_a_copy_whose_nixl_request_timed_out_is_never_settled():
    arena = HostBuffer(4 * PAGE)
    arena.array[:PAGE] = 7
    fence = MoveFence()
    mover = Mover(StuckAgent(), arena, PAGE, nvme=None, s3=None, bounce_bytes=0, fence=fence)
    item = moving.MoveItem(src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="dram",
                           dst_runs=[specs.PageRun(first=2, count=1)], dst_token="move-1-ab", nbytes=PAGE,
                           checksum=xxhash.xxh3_64(arena.view(0, PAGE)).hexdigest(), namespace_id="0" * 16,
                           hash="ab")
    peer = moving.Peer(agent_name="w1", agent_metadata="", base_addr=arena.addr, page_bytes=PAGE)
    result = mover.move(moving.MoveRequest(items=[item], peer=peer))
    assert result.codes == ["failed"] and "timed out" in result.errors[0]
    assert fence.fence(["move-1-ab"]) == [False]


def test_a_rejoin_waits_for_the_moves_of_the_old_epoch():
    import threading
    import time

    fence = MoveFence()
    assert fence.begin({"m"})
    threading.Timer(0.3, fence.end, args=({"m"},)).start()
    t0 = time.monotonic()
    assert fence.quiesce(5) and 0.25 < time.monotonic() - t0 < 3  # it waited for the running move
    assert fence.begin({"n"}) and not fence.quiesce(0.2)  # still running at the deadline


class Parked(NeverDone):
    """A request that times out while posted, and that NIXL finishes with later (`done`)."""

    done = False

    def settled(self) -> bool:
        return self.done


class ParkingAgent(StuckAgent):
    def __init__(self) -> None:
        self.posted: list[Parked] = []

    def submit(self, *args, **kwargs) -> Parked:
        self.posted.append(Parked())
        return self.posted[-1]

    def register_dram(self, addr: int, nbytes: int) -> None:
        pass


class ReachableS3:
    """The S3 tier's interface as far as the mover asks it before a request is posted."""

    def unreachable(self) -> None:
        return None

    def claim(self, name: str, token: str) -> None:
        pass

    def rows(self, agent, name: str, nbytes: int, dram_rows) -> np.ndarray:
        return np.array([(0, int(r[1]), 1) for r in dram_rows], dtype=np.uint64)


def test_bounce_pages_a_timed_out_request_may_still_use_are_not_reused_until_it_settles(tmp_path):
    from kvstore.worker.nvme import NvmeTier

    agent = ParkingAgent()
    mover = Mover(agent, HostBuffer(4 * PAGE), PAGE, nvme=NvmeTier(tmp_path, 8 * PAGE, PAGE), s3=ReachableS3(),
                  bounce_bytes=8 * PAGE)
    items = [moving.MoveItem(src_kind="nvme", src_runs=[specs.PageRun(first=2 * k, count=2)], dst_kind="s3",
                             dst_runs=[], dst_token="move-1-ab", nbytes=2 * PAGE, checksum="0" * 16,
                             namespace_id="0" * 16, hash=f"{k:032x}") for k in range(2)]
    result = mover.move(moving.MoveRequest(items=items))
    assert result.codes == ["failed", "failed"] and all("deadline passed" in e for e in result.errors)
    assert len(agent.posted) == 1  # one read for the batch, and no retry block by block after it timed out
    assert mover.bounce_pages.free_pages == 4  # the read may still write into the batch's 4 pages
    assert mover._bounce("next", PAGE) is not None and mover.bounce_pages.free_pages == 3
    agent.posted[0].done = True  # NIXL is done with it: the next allocation takes those pages back
    assert mover._bounce("after", PAGE) is not None and mover.bounce_pages.free_pages == 6


def test_a_read_into_dram_that_timed_out_is_not_retried_block_by_block(tmp_path):
    from kvstore.worker.nvme import NvmeTier

    agent = ParkingAgent()
    mover = Mover(agent, HostBuffer(8 * PAGE), PAGE, nvme=NvmeTier(tmp_path, 8 * PAGE, PAGE), s3=None,
                  bounce_bytes=0)
    items = [moving.MoveItem(src_kind="nvme", src_runs=[specs.PageRun(first=2 * k, count=2)], dst_kind="dram",
                             dst_runs=[specs.PageRun(first=2 * k, count=2)], dst_token="move-1-ab", nbytes=2 * PAGE,
                             checksum="0" * 16, namespace_id="0" * 16, hash=f"{k:032x}") for k in range(2)]
    result = mover.move(moving.MoveRequest(items=items))
    assert result.codes == ["failed", "failed"] and all("deadline passed" in e for e in result.errors)
    assert len(agent.posted) == 2  # one request per group; none more after they timed out
