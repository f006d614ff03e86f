"""The eviction orders' own process, spoken to as the directory does: frames in, answers out."""

from __future__ import annotations

import io

from kvstore.directory.db import engine as db
from kvstore.directory.moves.order_child import TierSpec, read_frame, serve, write_frame

EVICTION = {kind: "lru" for kind in ("hbm", "dram", "nvme", "s3")}


def answers(messages: list) -> list:
    source, out = io.BytesIO(), io.BytesIO()
    for message in messages:
        write_frame(source, message)
    source.seek(0)
    serve(source, out)
    out.seek(0)
    said = []
    while (frame := read_frame(out)) is not None:
        said.append(frame)
    return said


def test_changes_hits_and_asks_are_taken_in_their_order(tmp_path):
    url = f"sqlite:///{tmp_path / 'directory.db'}"
    db.upgrade(url)  # an empty tier: its build reads no rows
    dram = TierSpec(1, "dram", 1 << 20, 4096)
    said = answers([
        ("start", EVICTION, url),
        ("build", 1, dram),
        ("changed", None, [(10, None, "ns", "a", [1], []), (11, 10, "ns", "b", [1], []),
                           (12, None, "ns", "c", [1], [])]),
        ("hits", None, [([1], 10, "ns/a")]),  # 10 is now the most recently used
        ("evict", 2, dram, 2, set()),
        ("changed", None, [(10, None, "ns", "a", [], [1])]),  # left the tier
        ("evict", 3, dram, 5, set()),
    ])
    assert said == [(1, True, []), (2, True, [11, 12]), (3, True, None)]


def test_a_failed_ask_is_answered_and_the_next_one_still_served(tmp_path):
    url = f"sqlite:///{tmp_path / 'directory.db'}"
    db.upgrade(url)
    said = answers([
        ("start", EVICTION, url),
        ("evict", 1, TierSpec(2, "tape", None, 4096), 1, set()),  # a kind it has no policy for
        ("no such message", None),
        ("build", 2, TierSpec(1, "dram", 1 << 20, 4096)),
        ("evict", 3, TierSpec(1, "dram", 1 << 20, 4096), 1, set()),
    ])
    assert [(request, ok) for request, ok, _ in said] == [(1, False), (2, True), (3, True)]
    assert "KeyError" in said[0][2] and said[2][2] is None  # an empty tier's order runs dry


def test_without_a_start_it_ends_at_once():
    assert answers([("build", 1, TierSpec(1, "dram", 1 << 20, 4096))]) == []
