"""Moves whose NVMe destinations the worker places: the wire values refuse what cannot be meant, and
the NVMe manifest forgets every block of a token given back whole (the control endpoint's part is
in tests/component/test_worker_control.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvstore.core import moving, page_calls, specs
from kvstore.worker.nvme import NvmeTier

PAGE = 4096


def item(token: str, nbytes: int = PAGE, **fields) -> moving.MoveItem:
    values = dict(src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="nvme", dst_runs=[],
                  dst_token=token, nbytes=nbytes, checksum="0123456789abcdef", namespace_id="0" * 16, hash="ab",
                  allocate=True)
    return moving.MoveItem(**{**values, **fields})


def test_the_wire_values_refuse_placement_that_cannot_be_meant():
    with pytest.raises(ValidationError):
        item("t", dst_runs=[specs.PageRun(first=0, count=1)])  # pages given and asked for
    with pytest.raises(ValidationError):
        item("t", dst_kind="dram")  # memory tiers are the directory's to place
    with pytest.raises(ValidationError):
        page_calls.FreeItem(token="t", runs=[specs.PageRun(first=0, count=1)], all_pages=True)
    with pytest.raises(ValidationError):
        page_calls.FreeItem(token="t", runs=[], object="00/ab", all_pages=True)


def test_forgetting_a_whole_token_frees_every_block_recorded_under_it(tmp_path):
    nvme = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    placed = {}
    for token, name in (("move-1-a", "aa"), ("move-1-a", "bb"), ("move-2-b", "cc")):
        runs = nvme.allocator.allocate(token, PAGE)
        placed[name] = runs
        nvme.record(item(token, allocate=False, dst_runs=runs, hash=name))
    nvme.sync()
    assert nvme.allocator.release("move-1-a")
    nvme.forget("move-1-a", None)
    nvme.sync()
    nvme.close()
    again = NvmeTier(tmp_path, 16 * PAGE, PAGE)
    assert [s.hash for s in again.survivors()] == ["cc"]
    assert again.allocator.free_pages == 15 and again.allocator.owns("move-2-b", placed["cc"])
    again.close()


def test_the_new_fields_stay_off_the_wire_at_their_defaults():
    """A worker or directory from before the worker placed its pages forbids fields it does not know:
    what it can read is sent without them."""
    answer = moving.MoveResult(ok=[True], errors=[None], codes=["ok"])
    assert set(answer.model_dump()) == {"ok", "errors", "codes"}
    assert "allocate" not in item("t", allocate=False, dst_runs=[]).model_dump()
    assert "all_pages" not in page_calls.FreeItem(token="t", runs=[]).model_dump()
    placed = moving.MoveResult(ok=[True], errors=[None], codes=["ok"], dst_runs=[[specs.PageRun(first=0, count=1)]])
    assert item("t").model_dump()["allocate"] is True and placed.model_dump()["dst_runs"]


def test_an_answer_holds_one_value_per_item():
    with pytest.raises(ValidationError):
        moving.MoveResult(ok=[True, True], errors=[None, None], codes=["ok"])
    with pytest.raises(ValidationError):
        moving.MoveResult(ok=[True, True], errors=[None, None], dst_runs=[None])
    with pytest.raises(ValidationError):
        moving.MoveResult(ok=[True], errors=[])
