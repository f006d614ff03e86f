"""Relaxed commits on PostgreSQL: a database crash loses the last saves' commits, and with them
nothing else: the saves are misses, their pages come back, every other block stays; with the
setting off the same crash loses nothing."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from sqlalchemy.exc import OperationalError

from kvstore.client import DirectoryClient
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace
from tests.calls import chain, complete, hits, prepare
from tests.component.test_replicas import save
from tests.helpers import PostgresCluster, wait_until
from tests.stacks import NS, Verdicts, directory_replica, directory_stack, make_settings, registration, worker_endpoint

pytestmark = pytest.mark.postgres
PAGES = 32
# The WAL writer writes at most every 10 s, only whole pages of WAL in between, and the background
# writer writes no data page (each would write the WAL before it): an unflushed commit stays in
# the server's memory until the crash.
FLUSHED = Namespace(model_id="flushed", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)
LAZY_WAL = "-c wal_writer_delay=10000 -c wal_writer_flush_after=1GB -c bgwriter_lru_maxpages=0"
REAPER_S = 5.0  # each round commits (and so flushes) once: rarely between the last save and the crash


@pytest.fixture
def crashable():
    cluster = PostgresCluster(LAZY_WAL).start()
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("relaxed", [True, False])
def test_a_database_crash_loses_only_the_last_relaxed_saves_and_their_pages_come_back(crashable, relaxed):
    settings = make_settings(crashable.create_database(), heartbeat_timeout_s=600, relaxed_commits=relaxed,
                             reaper_interval_s=REAPER_S)
    with directory_stack(settings, pages=PAGES) as s:
        durable, last = chain(3), chain(3, start=100)
        complete(s, prepare(s, durable))
        each = PAGES - s.free_pages()  # pages a save of 3 blocks holds
        # a commit that waits for its flush (a new namespace) writes every commit before it too
        s.client.register_namespace(FLUSHED)
        complete(s, prepare(s, last))
        assert hits(s, last) == 3 and s.free_pages() == PAGES - 2 * each

        crashable.crash()

        def answers() -> bool:  # the leader noticed the restart and read its state again
            try:
                return s.client.stats().leader and s.service.changelog.incarnation is not None and \
                    not s.service.changelog.stale and hits(s, durable) == 3
            except Exception:  # noqa: BLE001 (the database is coming back)
                return False
        wait_until(answers, 60, "the directory answers again")
        if relaxed:
            wait_until(lambda: hits(s, last) == 0, 30, "the lost saves are misses")
            assert s.free_pages() == PAGES - each  # the lost save's pages came back, the durable one's did not
        else:
            assert hits(s, last) == 3 and s.free_pages() == PAGES - 2 * each
        again = prepare(s, last)  # saved again (relaxed) or found already there
        assert {b.status for b in again.blocks} == {"admitted" if relaxed else "exists"}
        if relaxed:
            complete(s, again)
        assert hits(s, last) == 3 and hits(s, durable) == 3 and s.free_pages() == PAGES - 2 * each


def test_a_reread_that_fails_part_way_is_made_again_until_it_succeeds(crashable):
    """The database drops again while the leader reads its state back after a crash (here: the page
    credit's rebuild, after the index's): the replica must not count itself as caught up, or it
    would serve with the lost saves' pages still taken, its page credit out of step with SQL."""
    settings = make_settings(crashable.create_database(), heartbeat_timeout_s=600, relaxed_commits=True,
                             reaper_interval_s=REAPER_S)
    with directory_stack(settings, pages=PAGES) as s:
        durable, last = chain(3), chain(3, start=100)
        complete(s, prepare(s, durable))
        each = PAGES - s.free_pages()
        s.client.register_namespace(FLUSHED)
        complete(s, prepare(s, last))
        pools, failures = s.service.pools, []
        rebuild = pools.rebuild

        def drops_once(*args, **kwargs):
            if not failures:
                failures.append(1)
                raise OperationalError("rebuild", {}, ConnectionError("the server closed the connection"))
            return rebuild(*args, **kwargs)
        pools.rebuild = drops_once

        crashable.crash()

        def caught_up() -> bool:
            try:
                return not s.service.changelog.stale and hits(s, last) == 0 and s.free_pages() == PAGES - each
            except Exception:  # noqa: BLE001 (the database is coming back)
                return False
        wait_until(caught_up, 60, "the state read back whole")
        assert failures and hits(s, durable) == 3


def test_after_the_crash_a_follower_forgets_the_lost_saves_it_had_applied(crashable):
    """A follower applied the lost commit's changes from the database's memory before the crash;
    whichever replica leads afterwards, neither names the lost blocks and the page credit gives
    their pages back."""
    database_url = crashable.create_database()
    with worker_endpoint(pages=PAGES, verifier=Verdicts()) as control, ExitStack() as replicas:
        # the leader's ticks are slow: a follower takes the lead, the other one follows it
        urls = [replicas.enter_context(directory_replica(database_url, heartbeat_timeout_s=600, relaxed_commits=True,
                                                         reaper_interval_s=REAPER_S))[1] for _ in range(3)]
        clients = [DirectoryClient(url) for url in urls]
        clients[0].register_worker(registration(control_url=control.url, pages=PAGES))
        namespace_id = clients[0].register_namespace(NS)
        durable, last = chain(3), chain(3, start=100)
        save(clients[0], namespace_id, durable)
        clients[0].register_namespace(FLUSHED)
        save(clients[0], namespace_id, last)
        for client in clients:
            wait_until(lambda c=client: c.lookup(namespace_id, last).num_hit_blocks == 3, 10, "applied")

        crashable.crash()

        def settled() -> bool:  # all three: a replica that lost the lead meanwhile follows again
            try:
                return sum(c.stats().leader for c in clients) == 1 and all(
                    c.lookup(namespace_id, durable).num_hit_blocks == 3 and
                    c.lookup(namespace_id, last).num_hit_blocks == 0 for c in clients)
            except KVStoreError:  # the database is coming back
                return False
        wait_until(settled, 60, "every replica forgot the lost saves")
        leader = next(c for c in clients if c.stats().leader)
        tier = leader.tiers()[0]  # the lost save's pages came back to the leader's page credit
        assert tier.credit_free_bytes == tier.capacity_bytes - 3 * NS.block_nbytes
