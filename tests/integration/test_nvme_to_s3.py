"""NVMe -> S3 for many blocks at once, with NIXL POSIX and OBJ against a real S3 endpoint (moto):
one read into the bounce buffer and one write of the objects; a block whose NVMe bytes no longer
match its checksum fails alone, and blocks the bounce buffer cannot hold at once still go."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import xxhash

from kvstore.core import moving, specs
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent
from kvstore.worker.mover import Mover
from kvstore.worker.nvme import NvmeTier
from kvstore.worker.s3 import S3Tier
from tests.stacks import s3_bucket

PAGE = 16 << 10
SIZES = [2 * PAGE + 100, PAGE, 3 * PAGE - 7, 2 * PAGE, PAGE + 1]  # 11 pages in all


@pytest.fixture
def s3(tmp_path, monkeypatch):
    with s3_bucket(tmp_path, monkeypatch, "batch-test") as moto:
        yield moto


def to_s3(tmp_path, s3, bounce_pages: int, corrupt: int | None = None):
    """SIZES blocks on NVMe (written there directly), moved to S3 in one move request: (the blocks'
    bytes and items, the result, the S3 tier, the NIXL requests as (op, memory, descriptors))."""
    arena = HostBuffer(16 * PAGE)
    nvme = NvmeTier(tmp_path / f"nvme-{bounce_pages}", 16 * PAGE, PAGE, direct="auto")
    tier = S3Tier(s3.url, "batch-test", "p", "us-east-1", False)
    agent = Agent(f"batch-{uuid.uuid4().hex[:8]}", {"POSIX": {"use_aio": "true"}, "OBJ": tier.backend_params()},
                  progress_thread=False)
    try:
        agent.register_dram(arena.addr, arena.nbytes)
        nvme.register(agent)
        mover = Mover(agent, arena, PAGE, nvme=nvme, s3=tier, bounce_bytes=bounce_pages * PAGE)
        submit, requests = agent.submit, []
        agent.submit = lambda op, local, remote, peer, local_mem, remote_mem: (
            requests.append((op, remote_mem, len(local))), submit(op, local, remote, peer, local_mem, remote_mem))[1]
        rng, items, first = np.random.default_rng(7), [], 0
        for k, nbytes in enumerate(SIZES):
            data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
            pages = -(-nbytes // PAGE)
            with open(tmp_path / f"nvme-{bounce_pages}" / "slab-0000.bin", "r+b") as slab:
                slab.seek(first * PAGE)
                slab.write(data[:-1] + bytes([data[-1] ^ 0xFF]) if k == corrupt else data)
            items.append((data, moving.MoveItem(
                src_kind="nvme", src_runs=[specs.PageRun(first=first, count=pages)], dst_kind="s3", dst_runs=[],
                dst_token=f"move-1-{k}", nbytes=nbytes, checksum=xxhash.xxh3_64(data).hexdigest(),
                namespace_id="0" * 16, hash=f"{k:032x}")))
            first += pages
        result = mover.move(moving.MoveRequest(items=[item for _, item in items]))
        assert mover.bounce_pages.free_pages == bounce_pages  # every bounce page came back
        return items, result, tier, requests
    finally:
        agent.close()
        nvme.close()


def stored(s3, key: str) -> bytes | None:
    try:
        return s3.client().get_object(Bucket="batch-test", Key=key)["Body"].read()
    except Exception:  # noqa: BLE001 (NoSuchKey)
        return None


def test_a_batch_goes_to_s3_and_a_corrupt_source_fails_alone(tmp_path, s3):
    items, result, tier, requests = to_s3(tmp_path, s3, bounce_pages=64, corrupt=2)
    assert result.codes == ["ok", "ok", "source_corrupt", "ok", "ok"]
    assert [(op, memory) for op, memory, _ in requests] == [("READ", "FILE"), ("WRITE", "OBJ")]  # one each
    assert requests[1][2] == len(SIZES) - 1  # every object but the corrupt one
    assert "after reading from NVMe" in result.errors[2]
    for k, (data, item) in enumerate(items):
        assert stored(s3, tier.key(f"{item.namespace_id}/{item.hash}")) == (None if k == 2 else data)


def test_blocks_the_bounce_buffer_cannot_hold_at_once_still_go(tmp_path, s3):
    items, result, tier, requests = to_s3(tmp_path, s3, bounce_pages=8)  # 11 pages of blocks; a batch takes 4
    assert result.codes == ["ok"] * len(SIZES)
    assert requests[:2] == [("READ", "FILE", 2), ("WRITE", "OBJ", 2)]  # the two that fit, then one by one
    for data, item in items:
        assert stored(s3, tier.key(f"{item.namespace_id}/{item.hash}")) == data


def test_a_late_delete_of_an_earlier_copy_keeps_the_object_a_newer_copy_wrote(tmp_path, s3):
    """A move to S3 that failed is given back after a newer move of the same block wrote its object
    (the same key): the late delete must not remove the newer copy; the newer copy's own delete does."""
    items, result, tier, _ = to_s3(tmp_path, s3, bounce_pages=64)  # claimed and written under move-1-<k>
    assert result.codes == ["ok"] * len(SIZES)
    name = f"{items[0][1].namespace_id}/{items[0][1].hash}"
    tier.delete(name, "move-1-older")  # the earlier, failed copy's free arrives late
    assert stored(s3, tier.key(name)) == items[0][0]
    tier.delete(name, items[0][1].dst_token)  # the newer copy given back: its object goes
    assert stored(s3, tier.key(name)) is None
