"""The directory's side of the eviction orders' process (`moves/order.py`), against an in-process
child that answers when the test says: what a late or lost answer does."""

from __future__ import annotations

import threading

import pytest

from kvstore.directory.moves import order
from kvstore.directory.moves.order import ChildOrder
from kvstore.directory.moves.order_child import TierSpec
from kvstore.directory.tier_policies import Unanswered
from kvstore.policies.hints import Hints

KINDS = ("hbm", "dram", "nvme", "s3")
DRAM = TierSpec(1, "dram", 1 << 20, 4096)


class Asked:
    def __init__(self, kind, args, then):
        self.kind, self.args, self.then = kind, args, then
        self.done = threading.Event()
        self.ok, self.value = False, None


class FakeChild:
    """`_Child`'s calls; asks wait until `answer` (or time out as the real one's do)."""

    def __init__(self, eviction, url):
        self.alive, self.ended_at, self.told, self.asked = True, float("inf"), [], []
        self.late = None
        self.proc = type("Proc", (), {"pid": 4242})()

    def tell(self, message):
        self.told.append(message)

    def request(self, kind, *args, then=None):
        self.asked.append(ask := Asked(kind, args, then))
        return ask

    def ask(self, kind, *args, timeout_s, late=None):
        asked = self.request(kind, *args)
        if not asked.done.wait(timeout_s):
            self.late = late
            return False, "no answer"
        return asked.ok, asked.value

    def answer(self, asked, ok, value):
        asked.ok, asked.value = ok, value
        if asked.then is not None:
            asked.then(ok, value)
        asked.done.set()

    def stalled(self):
        return self.late is not None

    def stop(self, why=None):
        self.alive = False


@pytest.fixture
def spawned() -> list[FakeChild]:
    return []


@pytest.fixture
def policies(monkeypatch, spawned):
    monkeypatch.setattr(order, "ASK_TIMEOUT_S", 0.05)  # a build's caller stops waiting at once
    monkeypatch.setattr(order, "EVICT_WAIT_S", 0.05)

    def spawn(eviction, url):
        spawned.append(FakeChild(eviction, url))
        return spawned[-1]
    return ChildOrder({k: "lru" for k in KINDS}, {k: "always" for k in KINDS}, "sqlite:///unused.db", spawn=spawn)


def test_a_build_answered_after_the_order_was_dropped_does_not_count(policies, spawned):
    policies.build(DRAM)  # asked; its caller stopped waiting
    child = spawned[-1]
    build = child.asked[-1]
    policies.unbuild(DRAM)  # the order ran dry meanwhile: this build is stale
    child.answer(build, True, [])
    assert not policies.built(DRAM)
    policies.build(DRAM)  # asked again
    child.answer(child.asked[-1], True, [("ns/a", 2)])
    assert policies.built(DRAM)


def test_victims_answered_late_go_back_and_no_ask_follows_until_then(policies, spawned):
    policies.build(DRAM)
    child = spawned[-1]
    child.answer(child.asked[-1], True, [])
    with pytest.raises(Unanswered):
        policies.evict(DRAM, 2, set())  # nobody answers within EVICT_WAIT_S: SQL's order
    asks = len(child.asked)
    with pytest.raises(Unanswered):
        policies.evict(DRAM, 2, set())  # not asked while the last is unanswered
    assert len(child.asked) == asks
    child.late([7, 8])  # the answer comes after all: nobody took them
    assert child.told[-1] == ("changed", None, [(7, None, "", "", [1], []), (8, None, "", "", [1], [])])


def test_without_a_child_evictions_are_unanswered_and_hints_wait_for_the_next(policies, spawned, monkeypatch):
    hints = Hints(session="chat-1", retain="turn")
    policies.expect(DRAM, [("ns", "h4", hints)])  # before any child: kept here
    policies.build(DRAM)
    first = spawned[-1]
    assert first.told[0] == ("expected", None, [((1, "ns", "h4"), hints)]) and not policies.expected()
    first.answer(first.asked[-1], True, [])
    first.alive = False  # it ended
    with pytest.raises(Unanswered):
        policies.evict(DRAM, 1, set())
    assert not policies.built(DRAM) and policies.dry_run(DRAM, 1, set(), 1) is None and policies.pid is None
    policies.expect(DRAM, [("ns", "h5", hints)])
    policies.changed([(5, None, "ns", "h5", [1], [])])  # committed: kept by block id until a child holds it
    assert policies.expected() == [((1, 5), hints)]
    first.ended_at = 0.0
    monkeypatch.setattr(order, "RESTART_AFTER_S", 0.0)
    policies.build(DRAM)  # a new child, handed what was kept
    second = spawned[-1]
    assert second is not first and second.told[0] == ("expected", None, [((1, 5), hints)])
    assert second.asked[-1].kind == "build" and not policies.built(DRAM)  # until it answers
