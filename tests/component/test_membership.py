"""Directory restarts keep committed state; a worker that stops heartbeating is declared dead."""

from __future__ import annotations

import pytest

from kvstore.client import DirectoryClient
from kvstore.directory.app import create_app
from tests.component.conftest import NS, make_settings
from tests.component.test_directory import chain, complete, hits, prepare
from tests.helpers import ServerThread, wait_until


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
    from kvstore.core.pages import PageAllocator
    from kvstore.worker.control import ControlServer
    from tests.component.conftest import Stack

    control = ControlServer({"dram": PageAllocator(32, 128)})
    control.start()
    try:
        with ServerThread(create_app(settings)) as server:
            client = DirectoryClient(server.url)
            s = Stack(server.url, client, None, control.allocators["dram"], client.register_namespace(NS), settings)
            s.register_worker(control_url=control.url)
            complete(s, prepare(s, chain(3)))
            dangling = prepare(s, chain(2, start=100))  # open at the "crash"
            assert dangling.token
        with ServerThread(create_app(settings)) as server:  # same database, new process state
            s.client = DirectoryClient(server.url)
            assert hits(s, chain(3)) == 3
            assert hits(s, chain(2, start=100)) == 0
            assert s.client.workers()[0].epoch == 1
    finally:
        control.stop()
