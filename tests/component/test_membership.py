"""Directory restarts keep committed state; a worker that stops heartbeating is declared dead."""

from __future__ import annotations

import pytest

from kvstore.core.pages import PageAllocator
from kvstore.worker.control import ControlServer
from tests.stacks import directory_stack, make_settings
from tests.component.test_directory import chain, complete, hits, prepare
from tests.helpers import wait_until


@pytest.fixture
def directory_settings(database_url):
    return make_settings(database_url, heartbeat_timeout_s=1.0)


def test_a_silent_worker_is_declared_dead_and_its_dram_replicas_leave_lookups(stack):
    hashes = chain(2)
    complete(stack, prepare(stack, hashes))
    assert hits(stack, hashes) == 2
    wait_until(lambda: stack.client.workers()[0].state == "dead", 10, "worker declared dead")
    assert hits(stack, hashes) == 0
    decision = prepare(stack, chain(1, start=500)).blocks[0]
    assert (decision.status, decision.reason) == ("rejected", "no_worker")


def test_a_restarted_directory_keeps_committed_blocks(database_url):
    settings = make_settings(database_url, heartbeat_timeout_s=600)
    control = ControlServer({"dram": PageAllocator(32, 128)})
    control.start()
    try:
        with directory_stack(settings, control) as s:
            complete(s, prepare(s, chain(3)))
            dangling = prepare(s, chain(2, start=100))  # open at the "crash"
            assert dangling.token
        with directory_stack(settings, control, register=False) as s:  # same database, new process state
            assert hits(s, chain(3)) == 3
            assert hits(s, chain(2, start=100)) == 0
            assert s.client.workers()[0].epoch == 1
    finally:
        control.stop()
