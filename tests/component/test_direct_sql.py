"""Statements sent straight to the driver (`kvstore.directory.db.direct`), on SQLite and on
PostgreSQL: a large read comes in batches (a server-side cursor on PostgreSQL), a reader may stop
early and its session goes on, and what the driver raises reaches callers as SQLAlchemy's kinds."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from kvstore.directory.db import direct
from kvstore.directory.db import engine as db
from kvstore.directory.db.models import NamespaceRow, Tier
from kvstore.directory.db.writer import Writer

INSERT = "INSERT INTO namespaces (id, spec, created_at) VALUES (?, '{}', 0)"
IDS = "SELECT id FROM namespaces ORDER BY id"


def test_a_large_read_comes_in_batches_and_a_reader_may_stop_early(database_url):
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    sessions = db.make_sessions(engine)
    names = [f"ns{i:03d}" for i in range(250)]
    writer = Writer(sessions)
    try:
        writer.run(lambda tx: direct.driver_many(tx.session, INSERT, [(name,) for name in names]))
        assert writer.run(lambda tx: [len(b) for b in direct.stream(tx.session, IDS, (), 100)]) == [100, 100, 50]
    finally:
        writer.close()

    with sessions() as session:
        batches = list(direct.stream(session, IDS, (), 100))
        assert [row[0] for batch in batches for row in batch] == names
        assert "wrote" not in session.info  # a read leaves its group nothing to commit

        early = direct.stream(session, IDS, (), 10)
        assert next(early)[0] == ("ns000",)
        early.close()  # stopped early: the session and its connection go on
        assert not session.connection().invalidated
        assert direct.rows(session, "SELECT count(*) FROM namespaces") == [(250,)]
        assert sum(len(batch) for batch in direct.stream(session, IDS, (), 64)) == 250  # the cursor's name is free

        with pytest.raises(DBAPIError) as raised:  # the statement's fault: the connection stays in the pool
            next(direct.stream(session, "SELECT id FROM nowhere"))
        assert "nowhere" in str(raised.value) and not raised.value.connection_invalidated
        session.rollback()

        session.connection().connection.driver_connection.close()  # the connection lost under the reader
        with pytest.raises(DBAPIError) as raised:
            next(direct.stream(session, IDS))
        assert raised.value.connection_invalidated and db.outage(raised.value) is not None
        session.rollback()
        assert direct.rows(session, "SELECT count(*) FROM namespaces") == [(250,)]  # a fresh connection
    engine.dispose()


@pytest.mark.parametrize("named", [3, 200])  # fewer rows named than the session holds, and more
def test_rows_the_driver_changed_are_expired_in_the_session_and_no_other(database_url, named):
    """After a driver UPDATE the session's ORM objects of the rows named read the database again
    (those attributes only); objects of rows not named, and of another model, keep what they held."""
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    sessions = db.make_sessions(engine)
    with sessions() as session:
        direct.driver_many(session, INSERT, [(f"ns{i}",) for i in range(6)])
        session.commit()
        held = {row.id: row for row in session.scalars(select(NamespaceRow))}
        assert {row.replicas for row in held.values()} == {1}
        direct.execute(session, "UPDATE namespaces SET replicas = 2, created_at = 5")
        ids = ["ns0", "ns1", "ns2"] + [f"absent{i}" for i in range(named - 3)]
        direct.expire_loaded(session, NamespaceRow, ids, ["replicas"])
        direct.expire_loaded(session, Tier, ["ns3"])  # another model's ids: nothing of these expires
        assert [held[f"ns{i}"].replicas for i in range(6)] == [2, 2, 2, 1, 1, 1]
        assert [held[f"ns{i}"].created_at for i in range(6)] == [0] * 6  # only the attributes named
    engine.dispose()
