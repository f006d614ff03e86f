"""The load path's SQL, straight through the database driver (see `saves.py` for why).

prepare_load pins each block it answers with one lease row, complete_load deletes
them: with thousands of blocks a call, ORM objects and SQLAlchemy's per-row
parameter processing cost more than the rows themselves.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from kvstore.directory.db.models.replica import DELETING, VISIBLE
from kvstore.directory.db.direct import chunks, driver_many, marks, rows


def pin(session: Session, replica_ids: list[int], token: str, holder: str, expires_at: float) -> set[int]:
    """Lease these replicas if they are still readable (READY or MOVING); returns the ids pinned."""
    readable: set[int] = set()
    for chunk in chunks(replica_ids):  # the state compared here, not in SQL (`direct.py`: by id)
        readable.update(r for r, state in rows(session, f"SELECT id, state FROM replicas WHERE id IN "
                                               f"({marks(len(chunk))})", tuple(chunk)) if state in VISIBLE)
    driver_many(session, "INSERT INTO leases (replica_id, token, holder, expires_at) VALUES (?, ?, ?, ?)",
                [(r, token, holder, expires_at) for r in replica_ids if r in readable])
    return readable


def release(session: Session, token: str) -> tuple[int, int]:
    """Delete the leases of `token`; returns (leases deleted, how many of their replicas are DELETING)."""
    ((leases, deleting),) = rows(
        session, f"SELECT count(*), coalesce(sum(CASE WHEN r.state = '{DELETING}' THEN 1 ELSE 0 END), 0) "
        "FROM leases l JOIN replicas r ON r.id = l.replica_id WHERE l.token = ?", (token,))
    if leases:
        driver_many(session, "DELETE FROM leases WHERE token = ?", [(token,)])
    return leases, deleting
