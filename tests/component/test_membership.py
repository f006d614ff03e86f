"""Directory restarts keep committed state; a worker that stops heartbeating is declared dead; a
live worker's name is its own."""

from __future__ import annotations

import pytest

from kvstore.core.errors import KVStoreError
from tests.stacks import directory_stack, make_settings, worker_endpoint
from tests.calls import chain, complete, hits, prepare
from tests.helpers import wait_until


@pytest.fixture
def directory_settings(database_url):
    return make_settings(database_url, heartbeat_timeout_s=3.0)


def test_a_silent_worker_is_declared_dead_and_its_dram_replicas_leave_lookups(stack):
    hashes = chain(2)
    stack.client.heartbeat("w0", stack.client.workers()[0].epoch)  # its last beat: 3 s to save and look up
    complete(stack, prepare(stack, hashes))
    assert hits(stack, hashes) == 2
    wait_until(lambda: stack.client.workers()[0].state == "dead", 20, "worker declared dead")
    assert hits(stack, hashes) == 0
    decision = prepare(stack, chain(1, start=500)).blocks[0]
    assert (decision.status, decision.reason) == ("rejected", "no_worker")


def test_a_restarted_directory_keeps_committed_blocks(database_url):
    settings = make_settings(database_url, heartbeat_timeout_s=600)
    with worker_endpoint() as control:
        with directory_stack(settings, control) as s:
            complete(s, prepare(s, chain(3)))
            dangling = prepare(s, chain(2, start=100))  # open at the "crash"
            assert dangling.token
        with directory_stack(settings, control, register=False) as s:  # same database, new process state
            assert hits(s, chain(3)) == 3
            assert hits(s, chain(2, start=100)) == 0
            assert s.client.workers()[0].epoch == 1


def test_a_live_workers_name_is_refused_to_a_second_worker_and_freed_when_it_stops_answering(database_url):
    with worker_endpoint() as first, worker_endpoint() as second:
        with directory_stack(make_settings(database_url, heartbeat_timeout_s=600), first) as s:
            assert s.client.worker("w0").control_url == first.url
            with pytest.raises(KVStoreError) as refused:  # same token, same name, another live endpoint
                s.register_worker(control_url=second.url)
            assert refused.value.kind == "conflict" and first.url in refused.value.message
            assert s.register_worker(control_url=first.url).epoch == 2  # the holder itself, again: fine
            first.stop()  # the holder died (its heartbeats would stop too, much later)
            assert s.register_worker(control_url=second.url).epoch == 3
            assert s.client.worker("w0").control_url == second.url
