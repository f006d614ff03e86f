"""The one writer (group commit) on a SQLite file: what follows a COMMIT failing does not turn the
commit into a failure, and the index reads back later what it could not read at once."""

from __future__ import annotations

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from kvstore.core.errors import KVStoreError
from kvstore.directory.db import engine as db
from kvstore.directory.db import writer as writer_module
from kvstore.directory.db.index import Index
from kvstore.directory.db.views import TierView, WorkerView
from kvstore.directory.db.models import NamespaceRow
from kvstore.directory.db.writer import Writer
from tests.helpers import wait_until


def index_of_three() -> Index:
    """An index holding blocks 0, 1 and 2 (hashes h0, h1, h2) on one DRAM tier."""
    index = Index()
    index.set_topology({1: WorkerView(1, "w", "w-agent", 1, "active")}, {10: TierView(10, 1, "dram", 128, 1 << 20)})
    index.add([(i, "ns", f"h{i}", None, 256, "0123456789abcdef", 100 + i, 10, 1, [[2 * i, 2]]) for i in range(3)])
    return index


def sessions_at(tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    db.upgrade(url)
    return db.make_sessions(db.make_engine(url))


def test_a_failure_after_the_commit_still_answers_the_caller_and_runs_after_commit_work(tmp_path):
    sessions = sessions_at(tmp_path)
    followed = []

    def on_commit(touched, topology, committed):
        followed.append(committed)
        raise RuntimeError("the database went away right after the COMMIT")

    writer = Writer(sessions, on_commit)
    after = []

    def job(tx):
        tx.session.add(NamespaceRow(id="ns1", spec={}, created_at=1.0))
        tx.committed([("a replica for the index",)])  # what the writer hands on_commit
        tx.after_commit.append(lambda: after.append("freed"))
        return "done"
    try:
        assert writer.run(job) == "done"  # before: the caller was told it failed
        assert after == ["freed"] and followed  # and the after-commit work had not run
        with sessions() as session:
            assert session.get(NamespaceRow, "ns1") is not None
    finally:
        writer.close()


class FlakySessions:
    """sessions() that fail the first `failures` times they are opened."""

    def __init__(self, sessions, failures: int) -> None:
        self.sessions, self.failures = sessions, failures

    def __call__(self):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("database away")
        return self.sessions()


def test_blocks_the_index_could_not_read_back_are_read_at_the_next_chance(tmp_path):
    index = index_of_three()
    flaky = FlakySessions(sessions_at(tmp_path), failures=1)
    index.follow_commit(flaky, {0, 1}, False, [])  # the read fails: owed
    assert index.lookup("ns", ["h0"])  # still the stale entry (no row for block 0 in this database)
    index.follow_commit(flaky, set(), False, [])  # the reaper's round: nothing new, the debt is read
    assert index.lookup("ns", ["h0"]) == [] and index.lookup("ns", ["h1"]) == []  # SQL has neither
    assert index.lookup("ns", ["h2"])  # not touched, kept


def test_an_index_with_nothing_owed_reads_nothing(tmp_path):
    flaky = FlakySessions(None, failures=5)
    Index().follow_commit(flaky, set(), False, [])
    assert flaky.failures == 5  # no session was asked for


def lose_commit_answers(sessions, when: str, times: int = 1) -> None:
    """The database connection drops around the next `times` COMMITs: `when` "after" (the COMMIT
    happened, its answer is lost) or "before" (it did not happen)."""
    left = [times]

    @event.listens_for(sessions, f"{when}_commit")
    def drop(_session) -> None:
        if left[0]:
            left[0] -= 1
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection unexpectedly"))


def namespace_job(log: list):
    def job(tx):
        tx.session.add(NamespaceRow(id="ns1", spec={}, created_at=1.0))
        tx.on_rollback.append(lambda: log.append("rolled back"))
        tx.after_commit.append(lambda: log.append("after commit"))
        return "done"
    return job


def test_a_commit_whose_answer_was_lost_but_that_happened_is_answered_as_committed(tmp_path):
    sessions = sessions_at(tmp_path)
    lose_commit_answers(sessions, "after")
    writer, log = Writer(sessions), []
    try:
        assert writer.run(namespace_job(log)) == "done"  # before: failed, its reservation given back
        assert log == ["after commit"]  # and a client's retry could commit the save a second time
    finally:
        writer.close()


def test_a_commit_whose_answer_was_lost_and_that_did_not_happen_is_rolled_back(tmp_path):
    sessions = sessions_at(tmp_path)
    lose_commit_answers(sessions, "before")
    writer, log = Writer(sessions), []
    try:
        with pytest.raises(KVStoreError) as failed:
            writer.run(namespace_job(log))
        assert failed.value.kind == "unavailable" and log == ["rolled back"]
        with sessions() as session:
            assert session.get(NamespaceRow, "ns1") is None
    finally:
        writer.close()


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_commit_nobody_can_tell_about_is_settled_once_the_database_answers_again(tmp_path, monkeypatch, when):
    """The COMMIT's answer is lost ("after": it happened; "before": it did not) and the database
    stays away past RESOLVE_S: the caller is told the outcome is unknown, nothing is settled yet
    (a reservation stays taken, not given back twice), and once the database answers again the
    group is settled as it would have been at once: after-commit work (a reservation released, a
    page credit returned) and the index reading the blocks back, or the rollback work."""
    sessions = sessions_at(tmp_path)
    monkeypatch.setattr(writer_module, "RESOLVE_S", 0.3)
    followed, log = [], []
    writer = Writer(sessions, lambda touched, topology, committed: followed.append((touched, committed)))

    @event.listens_for(sessions, f"{when}_commit")
    def database_gone(_session) -> None:
        if writer._sessions is sessions:
            writer._sessions = FlakySessions(sessions, failures=1000)  # every question goes unanswered
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection unexpectedly"))

    def job(tx):
        tx.committed([(7, "ns", "h7")])  # a block the group committed, for the index
        return namespace_job(log)(tx)
    try:
        with pytest.raises(KVStoreError) as unknown:
            writer.run(job)
        assert unknown.value.kind == "unavailable" and "did not say whether" in unknown.value.message
        assert log == [] and followed == [] and writer.unresolved == 1
        writer._sessions.failures = 3  # the database answers again, three questions later
        wait_until(lambda: writer.unresolved == 0, 30, "the outcome settled")
        if when == "after":
            assert log == ["after commit"] and followed == [({7}, [])]  # read back from SQL, not taken as said
        else:
            assert log == ["rolled back"] and followed == []
        with sessions() as session:
            assert (session.get(NamespaceRow, "ns1") is not None) == (when == "after")
    finally:
        writer.close()


def test_a_read_runs_beside_a_job_that_holds_the_writer_and_changes_nothing(tmp_path):
    import threading

    sessions = sessions_at(tmp_path)
    writer = Writer(sessions)
    holding, release = threading.Event(), threading.Event()

    def long_job(tx) -> None:
        holding.set()
        release.wait(10)
    pending = threading.Thread(target=writer.run, args=(long_job,))
    pending.start()
    try:
        assert holding.wait(10)

        def read(tx) -> int:
            tx.session.add(NamespaceRow(id="n" * 16, spec={}, created_at=0.0))
            tx.session.flush()
            return tx.session.query(NamespaceRow).count()
        assert writer.read(read) == 1  # answered while the writer is busy, on this thread
    finally:
        release.set()
        pending.join(10)
    assert writer.run(lambda tx: tx.session.query(NamespaceRow).count()) == 0  # nothing a read did stays
    writer.close()


def test_a_job_run_alone_shares_its_group_with_no_job_queued_before_or_after_it(tmp_path):
    import threading

    from tests.helpers import wait_until

    writer = Writer(sessions_at(tmp_path))
    holding, release = threading.Event(), threading.Event()
    groups: dict[str, int] = {}  # job -> groups committed before its own: the same within a group

    def long_job(tx) -> None:
        holding.set()
        release.wait(10)

    def job(name: str):
        def run(tx) -> None:
            groups[name] = writer.groups
        return run
    threads = [threading.Thread(target=writer.run, args=(long_job,))]
    threads[0].start()
    assert holding.wait(10)
    for queued, (name, call) in enumerate((("before", writer.run), ("alone", writer.run_alone),
                                            ("after", writer.run)), start=1):
        threads.append(threading.Thread(target=call, args=(job(name),)))
        threads[-1].start()
        wait_until(lambda: writer._queue.qsize() == queued, 10, f"{name} queued")  # in this order, writer busy
    release.set()
    for thread in threads:
        thread.join(10)
    writer.close()
    assert groups == {"before": 1, "alone": 2, "after": 3}  # after the long job's group, one group each


def test_a_group_that_only_reads_writes_no_commit_mark_and_every_kind_of_write_does(tmp_path):
    """The mark (and on PostgreSQL the leader's term check and change log) is skipped only for a
    group with nothing to commit: ORM changes, statements through the session and through the
    driver each count as writes."""
    from sqlalchemy import delete, func, select

    from kvstore.directory.db import direct
    from kvstore.directory.db.models import CommitMark

    writer = Writer(sessions_at(tmp_path))

    def marks() -> int:
        return writer.run(lambda tx: tx.session.scalar(select(func.count()).select_from(CommitMark)))
    assert marks() == 0  # the counting itself only reads
    writes = [lambda tx: tx.session.add(NamespaceRow(id="n" * 16, spec={}, created_at=0.0)),
              lambda tx: tx.session.execute(delete(NamespaceRow).where(NamespaceRow.id == "x")),
              lambda tx: direct.execute(tx.session, "DELETE FROM namespaces WHERE id = ?", ("x",))]
    for done, write in enumerate(writes, start=1):
        writer.run(write)
        assert marks() == done
    writer.close()


def test_statements_straight_to_the_driver_fail_as_sqlalchemy_would_and_roll_back_their_job(tmp_path):
    """`direct` runs its statements on the DBAPI cursor, past SQLAlchemy's execution: what the driver
    raises still reaches callers as SQLAlchemy's exception kinds (what `engine.outage` reads to
    answer 503 rather than 500), a job that fails is rolled back with what its statement wrote
    before failing, and a connection the driver reports closed is invalidated, so the pool does not
    hand it out again."""
    from sqlalchemy import select
    from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

    from kvstore.directory.db import direct

    sessions = sessions_at(tmp_path)
    writer = Writer(sessions)
    insert = "INSERT INTO namespaces (id, spec, created_at) VALUES (?, '{}', 0)"
    try:
        writer.run(lambda tx: direct.execute(tx.session, insert, ("ns1",)))
        with pytest.raises(IntegrityError) as raised:  # the same id again: the driver's IntegrityError
            writer.run(lambda tx: direct.execute(tx.session, insert, ("ns1",)))
        assert "namespaces" in str(raised.value) and db.outage(raised.value) is None  # a bug, not an outage
        with pytest.raises(IntegrityError):
            writer.run(lambda tx: direct.driver_many(tx.session, insert, [("ns2",), ("ns1",)]))
        assert writer.run(lambda tx: direct.rows(tx.session, "SELECT id FROM namespaces ORDER BY id")) == [("ns1",)]
    finally:
        writer.close()

    with sessions() as session:  # the driver's connection closed under the session: a lost connection
        session.connection().connection.driver_connection.close()
        with pytest.raises(DBAPIError) as raised:
            direct.rows(session, "SELECT 1")
        assert raised.value.connection_invalidated and db.outage(raised.value) is not None
        session.rollback()
        assert session.scalar(select(NamespaceRow.id)) == "ns1"  # a fresh connection from the pool

    with sessions.kw["bind"].connect() as connection:  # SQLite's BEGIN, sent to the driver the same way
        connection.connection.driver_connection.close()
        with pytest.raises(DBAPIError) as raised:
            connection.begin()
        assert raised.value.connection_invalidated and db.outage(raised.value) is not None

    with sessions() as session:  # a large read in batches: the same kinds, and a reader may stop early
        assert [batch for batch in direct.stream(session, "SELECT id FROM namespaces", (), 1)] == [[("ns1",)]]
        with pytest.raises(OperationalError):
            next(direct.stream(session, "SELECT id FROM nowhere"))
        session.rollback()
        batches = direct.stream(session, "SELECT 1 UNION ALL SELECT 2", (), 1)
        assert next(batches) == [(1,)]
        batches.close()  # stopped early: the connection stays good
        assert not session.connection().invalidated
        session.connection().connection.driver_connection.close()
        with pytest.raises(DBAPIError) as raised:
            next(direct.stream(session, "SELECT 1"))
        assert raised.value.connection_invalidated and db.outage(raised.value) is not None
