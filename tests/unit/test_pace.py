"""Tier-sized loops rest while the event loop answers hot calls, and only then."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kvstore.core import pace


@pytest.fixture
def rests(monkeypatch):
    """pace's view of `time`: the real clock, rests recorded instead of slept."""
    recorded: list[float] = []
    monkeypatch.setattr(pace, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=recorded.append))
    monkeypatch.setattr(pace, "WORK_S", 0.0)  # every check finds a slice of work done
    monkeypatch.setattr(pace, "_last_served", float("-inf"))
    monkeypatch.setattr(pace, "_loop_threads", set())
    return recorded


def _served_on_another_thread() -> None:
    answering = threading.Thread(target=pace.served)
    answering.start()
    answering.join()


def _tier_sized_loop(n: int = 64) -> list[int]:
    with pace.tier_sized():
        return list(pace.paced(range(n), every=16))


def test_a_tier_sized_loop_rests_at_every_check_while_calls_come(rests):
    _served_on_another_thread()
    assert _tier_sized_loop() == list(range(64))
    assert rests == [pace.REST_S] * 4


def test_a_loop_outside_tier_sized_work_never_rests(rests):
    _served_on_another_thread()
    assert list(pace.paced(range(64), every=16)) == list(range(64))  # a small save's step on a thread
    with pace.tier_sized(False):
        assert list(pace.paced(range(64), every=16)) == list(range(64))
    assert rests == []


def test_a_loop_never_rests_when_nobody_calls(rests):
    assert _tier_sized_loop() == list(range(64))
    assert rests == []


def test_calls_answered_long_ago_are_not_coming(rests, monkeypatch):
    _served_on_another_thread()
    monkeypatch.setattr(pace, "_last_served", time.perf_counter() - 2 * pace.RECENT_S)
    _tier_sized_loop()
    assert rests == []


def test_the_event_loop_itself_never_rests(rests):
    pace.served()  # this thread answered the call: it is the loop
    assert _tier_sized_loop() == list(range(64))
    assert rests == []
