"""The tiers' eviction orders in a process of their own (`moves/order.py`): what it orders, what
happens while it is gone, its start again, and its end with the directory (SQLite and PostgreSQL)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvstore.core import specs
from kvstore.directory.db import moves as sql
from kvstore.directory.moves import order
from tests.calls import chain, complete, hits, prepare, read
from tests.stacks import directory_stack, make_settings, worker_endpoint


@pytest.fixture
def control():
    with worker_endpoint(32) as control:  # room for 16 blocks
        yield control


def gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            os.waitpid(pid, os.WNOHANG)  # a child of this process: reaped, or it lingers as a zombie
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def two_chains(s) -> tuple[list[str], list[str]]:
    """Two chains of 3 on the tier; the first read since, so the second is the least recently used."""
    cold, warm = chain(3), chain(3, start=100)
    complete(s, prepare(s, cold))
    complete(s, prepare(s, warm))
    assert read(s, cold) == 3
    s.service.flush()  # the reads reach SQL: its order, and what the child builds from
    return cold, warm


def evict(s, limit: int, dry_run: bool = False):
    return s.client.evict_tier(specs.EvictRequest(tier="dram", limit=limit, dry_run=dry_run))


def kill(policies) -> None:
    pid = policies.pid
    assert pid is not None  # the premise: it runs
    os.kill(pid, signal.SIGKILL)
    assert gone(pid)
    deadline = time.monotonic() + 10
    while policies.pid is not None and time.monotonic() < deadline:  # its pipe's end reaches the directory
        time.sleep(0.05)
    assert policies.pid is None


def sql_order_refused(monkeypatch) -> None:
    """Victims in SQL's order would fail the test: the child's order must name them."""
    def refused(*args, **kwargs):
        raise AssertionError("victims came from SQL's order")
    monkeypatch.setattr(sql, "demotion_candidates", refused)


def test_the_child_orders_evictions_and_ends_with_the_directory(database_url, control, monkeypatch):
    sql_order_refused(monkeypatch)
    with directory_stack(make_settings(database_url), control) as s:
        policies = s.service.policies
        cold, warm = chain(3), chain(3, start=100)
        complete(s, prepare(s, cold))
        complete(s, prepare(s, warm))
        assert policies.pid is None  # started when a tier's order is first needed, not before
        before = evict(s, 2, dry_run=True)  # builds the order: the cold chain saved first, the oldest
        pid = policies.pid
        assert pid is not None and pid != os.getpid()
        assert (before.replicas, before.dropped) == (2, 2) and hits(s, cold) == 3  # a dry run changes nothing
        assert read(s, cold) == 3  # the loads' hits reach the child: now the warm chain is the oldest
        s.service.flush()  # the reaper's round that hands the hits on has run
        complete(s, prepare(s, chain(2, start=500)))  # reported to the child after their commit
        assert read(s, chain(2, start=500)) == 2
        assert evict(s, 2).dropped == 2
        assert hits(s, warm) == 1 and hits(s, cold) == 3 and hits(s, chain(2, start=500)) == 2
    assert gone(pid)


def test_while_the_child_is_gone_evictions_take_sqls_order_then_it_starts_again(database_url, control,
                                                                               monkeypatch):
    monkeypatch.setattr(order, "RESTART_AFTER_S", 3600.0)
    with directory_stack(make_settings(database_url), control) as s:
        policies = s.service.policies
        cold, warm = two_chains(s)
        assert evict(s, 1, dry_run=True).replicas == 1
        kill(policies)
        dry = evict(s, 2, dry_run=True)  # SQL's least recently used first: the warm chain's tail
        assert (dry.replicas, dry.dropped) == (2, 2) and policies.pid is None
        assert evict(s, 1).dropped == 1
        assert hits(s, warm) == 2 and hits(s, cold) == 3
        monkeypatch.setattr(order, "RESTART_AFTER_S", 0.0)
        sql_order_refused(monkeypatch)
        assert evict(s, 1).dropped == 1  # the next order needed starts it, built from SQL
        assert policies.pid is not None
        assert hits(s, warm) == 1 and hits(s, cold) == 3
        kill(policies)  # and again: started again at once, built from SQL anew
        assert evict(s, 1).dropped == 1
        assert hits(s, warm) == 0 and hits(s, cold) == 3
