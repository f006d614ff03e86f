"""The NVMe manifest names a block only after its bytes are durable (no NIXL: the slab writes are
the test's own)."""

from __future__ import annotations

import os

from kvstore.core import moving, specs
from kvstore.worker.nvme import MANIFEST, NvmeTier

PAGE = 4096


def item(token: str, first: int) -> moving.MoveItem:
    return moving.MoveItem(src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="nvme",
                          dst_runs=[specs.PageRun(first=first, count=1)], dst_token=token, nbytes=PAGE,
                          checksum="0123456789abcdef", namespace_id="ns", hash=f"{first:032x}")


def test_a_put_line_is_written_after_the_slab_data_is_fsynced(tmp_path, monkeypatch):
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    tier.record(item("t1", 3))
    assert (tmp_path / MANIFEST).read_text() == ""  # not before the data is durable
    tier.sync()
    manifest_fd = tier._manifest.fileno()
    assert synced.index(tier.fds[0]) < synced.index(manifest_fd)  # slab first, then the manifest
    assert '"op": "put"' in (tmp_path / MANIFEST).read_text()
    tier.close()
    assert [s.hash for s in NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors()] == [f"{3:032x}"]


def test_a_block_freed_before_its_line_was_written_leaves_no_line(tmp_path):
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    tier.record(item("t1", 5))
    tier.forget("t1", [specs.PageRun(first=5, count=1)])
    tier.sync()
    assert (tmp_path / MANIFEST).read_text() == ""
    tier.close()
    assert NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors() == []


def test_a_free_after_the_put_is_recorded_and_replayed(tmp_path):
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    tier.record(item("t1", 7))
    tier.sync()
    tier.forget("t1", [specs.PageRun(first=7, count=1)])
    tier.sync()
    tier.close()
    assert NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors() == []
