"""The NVMe manifest names a block only after its bytes are durable (no NIXL: the slab writes are
the test's own)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from kvstore.core import moving, specs
from kvstore.core.errors import KVStoreError
from kvstore.worker import nvme
from kvstore.worker.nvme import MANIFEST, NvmeTier

PAGE = 4096


def item(token: str, first: int) -> moving.MoveItem:
    return moving.MoveItem(src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="nvme",
                          dst_runs=[specs.PageRun(first=first, count=1)], dst_token=token, nbytes=PAGE,
                          checksum="0123456789abcdef", namespace_id="ns", hash=f"{first:032x}")


def ops(tmp_path) -> list[str]:
    """The manifest's lines by op, after its first (the page size)."""
    lines = [json.loads(line) for line in (tmp_path / MANIFEST).read_text().splitlines()]
    assert lines[0] == {"op": "meta", "page_bytes": PAGE}
    return [line["op"] for line in lines[1:]]


def test_a_put_line_is_written_after_the_slab_data_is_durable(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "SLAB_BYTES", 4 * PAGE)  # four slabs of four pages
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd)))
    tier.record(item("t1", 3))
    tier.record(item("t2", 9))
    assert ops(tmp_path) == []  # not before the data is durable
    tier.sync()
    manifest_fd = tier._manifest
    assert synced == [tier.fds[0], tier.fds[2], manifest_fd]  # the slabs written, then the manifest
    assert ops(tmp_path) == ["put", "put"]
    synced.clear()
    tier.record(item("t3", 13))
    tier.sync()
    assert synced == [tier.fds[3], manifest_fd]  # only what was written since
    tier.close()
    assert sorted(s.hash for s in NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors()) == \
        [f"{n:032x}" for n in (3, 9, 13)]


def test_a_block_freed_before_its_line_was_written_leaves_no_line(tmp_path):
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    tier.record(item("t1", 5))
    tier.forget("t1", [specs.PageRun(first=5, count=1)])
    tier.sync()
    assert ops(tmp_path) == []
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


def _disk_full(monkeypatch, after_bytes: int) -> None:
    """os.write as on a disk with `after_bytes` left: a short write, then ENOSPC."""
    real_write, left = os.write, [after_bytes]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(data)[:left[0]])
        left[0] -= n
        return n
    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_leaves_no_torn_line_and_the_frees_are_written_later(tmp_path, monkeypatch):
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    tier.record(item("t1", 1))
    tier.sync()
    before = (tmp_path / MANIFEST).read_text()
    tier.forget("t1", [specs.PageRun(first=1, count=1)])
    tier.record(item("t2", 1))  # the freed page reused
    with monkeypatch.context() as m:
        _disk_full(m, after_bytes=40)  # half a line fits
        with pytest.raises(KVStoreError) as err:
            tier.sync()
        assert err.value.kind == "unavailable" and "No space" in err.value.message
        assert (tmp_path / MANIFEST).read_text() == before  # cut back: no half line
        assert "No space" in tier.sync_moves([item("t2", 1)])  # the move's put is dropped: reported failed
    assert (tmp_path / MANIFEST).read_text() == before
    tier.sync()  # space again: the free goes out, the dropped put does not
    assert ops(tmp_path) == ["put", "free"]
    tier.close()
    assert NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors() == []


def test_a_line_torn_by_a_crash_does_not_swallow_the_next_one(tmp_path):
    (tmp_path / MANIFEST).write_text('{"op": "put", "tok')
    tier = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    tier.record(item("t1", 2))
    tier.sync()
    tier.close()
    assert [s.hash for s in NvmeTier(tmp_path, 16 * PAGE, PAGE).survivors()] == [f"{2:032x}"]


def test_a_directory_keeps_the_page_size_it_was_created_with(tmp_path):
    tier = NvmeTier(tmp_path, 64 * PAGE, 4 * PAGE)
    tier.record(item("t1", 3))
    tier.sync()
    tier.close()
    again = NvmeTier(tmp_path, 64 * PAGE, PAGE)  # the setting changed; the slabs' page numbers did not
    assert again.page_bytes == 4 * PAGE and again.allocator.num_pages == 16
    assert [s.hash for s in again.survivors()] == [f"{3:032x}"]


def test_a_manifest_from_before_page_sizes_were_recorded_is_read_with_the_legacy_size(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"op": "put", "token": "t1", "runs": [[2, 1]], "namespace_id": "ns",
                                                 "hash": f"{2:032x}", "nbytes": PAGE, "checksum": "0" * 16}) + "\n")
    (tmp_path / MANIFEST).write_text((tmp_path / MANIFEST).read_text() + "[1, 2]\n")  # valid JSON, not an entry
    tier = NvmeTier(tmp_path, 64 * PAGE, PAGE, legacy_page_bytes=16 * PAGE)
    assert tier.page_bytes == 16 * PAGE and len(tier.survivors()) == 1
    tier.close()
    # the size it was read with is written down: a later setting (and legacy guess) changes nothing
    again = NvmeTier(tmp_path, 64 * PAGE, PAGE, legacy_page_bytes=PAGE)
    assert again.page_bytes == 16 * PAGE and [s.runs[0].first for s in again.survivors()] == [2]
    assert json.loads((tmp_path / MANIFEST).read_text().splitlines()[0]) == {"op": "meta", "page_bytes": 16 * PAGE}
