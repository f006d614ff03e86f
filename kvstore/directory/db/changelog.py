"""The leader's side of SQL: its term checked, the change log followers read, and the advisory lock.

    log = ChangeLog(enabled, role)      # enabled: PostgreSQL (replicas may run side by side); the
                                        # replica's role (`role.py`) says whether and in which term it leads
    log.relaxed / log.stale / log.adopt(session)   # relaxed commits: has the database restarted since?
    Writer(..., before_commit=log.before_commit)   # every group commit checks the term and logs

Each group commit of the leader logs the blocks it touched (and whether workers, tiers or
namespaces changed, and the hand-offs it committed) in `changes`, in the same transaction, and
notifies CHANNEL; followers read the log from `changes_after`.

With relaxed commits (saves commit before their WAL is flushed: `writer.py`), a
database crash may lose the last of them, and what this replica holds in memory
(index, page credit, reservations; a follower's index) may name blocks that are
gone. So every group also checks the database's start time
(`pg_postmaster_start_time()`, in the term check's own statement): once it
differs from the one this replica read its state under (`adopt`), `stale` is
set and no group commits until the replica has read its state from SQL again,
which adopts the new start time. A restart that lost nothing costs the same
re-read: nothing tells the two apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.orm import Session

from kvstore.core.errors import KVStoreError
from kvstore.directory.db.models import Change, LeaderRow, Worker
from kvstore.directory.role import Role

log = logging.getLogger(__name__)
LOCK_KEY = 0x6B7673746F7265  # the advisory lock of the leader ("kvstore")
CHANNEL = "kvstore_changes"


class ChangeLog:
    def __init__(self, enabled: bool = False, role: Role | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.enabled = enabled
        self.role = role or Role(alone=not enabled)
        self._clock = clock
        self.relaxed = False  # saves may commit before their WAL is flushed (a setting; PostgreSQL)
        self.incarnation = None  # the database's start time when this replica last read its state
        self.stale = False  # the database restarted since: this replica's memory may name lost commits

    def adopt(self, session: Session) -> None:
        """This replica's state is being read from SQL in `session`: it holds for the database as it runs now."""
        self.incarnation = started(session)
        self.stale = False

    def restarted(self, session: Session) -> bool:
        """With relaxed commits: whether the database started again since this replica's state was read."""
        if self.relaxed:
            self._compare(started(session))
        return self.stale

    def _compare(self, start_time) -> None:
        if start_time != self.incarnation:
            self.stale = True

    def before_commit(self, session: Session, touched: set[int], topology: bool, namespaces: bool,
                      committed: list, handoffs: set[str]) -> None:
        """In each group's transaction: the term is still ours (else roll back and stop), and what
        the group changed is logged for the followers."""
        role = self.role
        if not role.checks:
            return
        check = update(LeaderRow).where(LeaderRow.id == 1, LeaderRow.term == role.term).values(term=LeaderRow.term)
        if role.lost:  # a job made while it led must not commit now, even if nobody has raised the term yet
            ours = False
        elif self.relaxed:
            row = session.execute(check.returning(func.pg_postmaster_start_time())).first()
            ours = row is not None
            if ours:
                self._compare(row[0])
        else:
            ours = session.execute(check).rowcount == 1
        if not ours:
            role.lose(f"another replica leads now (this one led in term {role.term})")
            raise KVStoreError("unavailable", "this directory replica no longer leads; ask another")
        if self.stale:
            raise KVStoreError("unavailable", "the database restarted and may have lost its last relaxed commits; "
                               "the directory is reading its state from SQL again", retry_after_s=1)
        blocks = touched | {row[0] for row in committed}
        if blocks or topology or namespaces or handoffs:
            session.execute(insert(Change).values(at=self._clock(), blocks=",".join(map(str, sorted(blocks))),
                                                  topology=topology, namespaces=namespaces,
                                                  handoffs=",".join(sorted(handoffs))))
            session.execute(text(f"NOTIFY {CHANNEL}"))


# ---- the advisory lock, on a psycopg connection of its own ----------------------------------------------

def connect(engine: Engine, listen: bool):
    import psycopg  # the PostgreSQL driver: present wherever a postgresql+psycopg URL works

    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(url, autocommit=True)
    if listen:
        conn.execute(f"LISTEN {CHANNEL}")
    return conn


def try_lock(conn) -> bool:
    return conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]


def unlisten(conn) -> None:
    conn.execute(f"UNLISTEN {CHANNEL}")


def still_connected(conn) -> bool:
    """Whether the lock's connection (and so the lock) is still there."""
    try:
        conn.execute("SELECT 1")
        return True
    except Exception:  # noqa: BLE001 (any failure of the lock's connection ends the lead)
        return False


# ---- the leader row and the log -----------------------------------------------------------------------

def leader_url(session: Session) -> str:
    row = session.get(LeaderRow, 1)
    return row.url if row is not None else ""


def live_workers(session: Session, since: float) -> int:
    return session.scalar(select(func.count()).select_from(Worker).where(
        Worker.state != "dead", Worker.heartbeat_at >= since))


def raise_term(session: Session, url: str, now: float) -> int:
    return session.execute(update(LeaderRow).where(LeaderRow.id == 1).values(
        term=LeaderRow.term + 1, url=url, since=now).returning(LeaderRow.term)).scalar_one()


def started(session: Session):
    """When the database server started (a crash and restart changes it)."""
    return session.scalar(select(func.pg_postmaster_start_time()))


def term(session: Session) -> int | None:
    return session.scalar(select(LeaderRow.term).where(LeaderRow.id == 1))


def last_change(session: Session) -> int:
    return session.scalar(select(func.coalesce(func.max(Change.id), 0)))


def pruned_below(session: Session) -> int:
    return session.scalar(select(LeaderRow.pruned_below).where(LeaderRow.id == 1)) or 0


def prune(session: Session, below: int) -> None:
    session.execute(Change.__table__.delete().where(Change.id < below))
    session.execute(update(LeaderRow).where(LeaderRow.id == 1).values(pruned_below=below))


class Changes(NamedTuple):
    last: int  # the id of the last change read
    count: int
    blocks: set[int]
    topology: bool
    namespaces: bool
    handoffs: list[str]


def changes_after(session: Session, last: int, limit: int) -> Changes | None:
    rows = session.execute(select(Change.id, Change.blocks, Change.topology, Change.namespaces, Change.handoffs)
                           .where(Change.id > last).order_by(Change.id).limit(limit)).all()
    if not rows:
        return None
    return Changes(last=rows[-1].id, count=len(rows),
                   blocks={int(b) for row in rows if row.blocks for b in row.blocks.split(",")},
                   topology=any(row.topology for row in rows), namespaces=any(row.namespaces for row in rows),
                   handoffs=[k for row in rows if row.handoffs for k in row.handoffs.split(",")])
