"""The save path's SQL, straight through the database driver.

prepare_store and complete_store run these once per save, with one row per
block: SQLAlchemy's per-row parameter processing and ORM loading cost more
than SQLite itself (about 100 µs a block against 10). The statements are
plain SQL that SQLite and PostgreSQL both take; `?` placeholders become `%s`
for drivers that want them.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from sqlalchemy.orm import Session

from kvstore.directory.models.replica import READY, WRITING
from kvstore.directory.repository import CHUNK, WritingRow, driver, driver_many, readable

ROWS_PER_INSERT = 500  # rows of one multi-row INSERT: 8 columns stay under every driver's parameter limit


class KnownBlock(NamedTuple):
    """A block the directory already has, as prepare_store checks it."""
    id: int
    depth: int
    ready: bool  # some replica is readable
    writing: bool  # a reservation of a live epoch is being written


class PlacementTier(NamedTuple):
    """A memory tier new blocks may go to, with what placement, admission and locations need."""
    id: int
    worker_id: int
    kind: str
    capacity_bytes: int | None
    used_bytes: int
    page_bytes: int
    base_addr: int


class PlacementWorker(NamedTuple):
    id: int
    name: str
    agent_name: str
    epoch: int


def rows(session: Session, sql: str, params: tuple = ()) -> list[tuple]:
    connection, sql = driver(session, sql)
    return list(connection.exec_driver_sql(sql, params))


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def known_blocks(session: Session, namespace_id: str, hashes: list[str]) -> dict[str, KnownBlock]:
    """hash -> what the directory has of it, one query per 500 hashes (blocks and their replicas)."""
    found: dict[str, list] = {}
    for start in range(0, len(hashes), CHUNK):
        chunk = hashes[start : start + CHUNK]
        for block_hash, block_id, depth, state, epoch, kind, worker_state, worker_epoch in rows(
                session, "SELECT b.hash, b.id, b.depth, r.state, r.epoch, t.kind, w.state, w.epoch FROM blocks b "
                "LEFT JOIN replicas r ON r.block_id = b.id LEFT JOIN tiers t ON t.id = r.tier_id "
                f"LEFT JOIN workers w ON w.id = t.worker_id WHERE b.namespace_id = ? AND b.hash IN ({_marks(len(chunk))})",
                (namespace_id, *chunk)):
            known = found.setdefault(block_hash, [block_id, depth, False, False])
            if state is not None:
                known[2] |= readable(state, epoch, kind, worker_state, worker_epoch)
                known[3] |= state == WRITING and epoch == worker_epoch
    return {h: KnownBlock(*v) for h, v in found.items()}


def placement_tiers(session: Session, kind: str) -> list[tuple[PlacementTier, PlacementWorker]]:
    """The tiers of `kind` on active workers."""
    return [(PlacementTier(*row[:7]), PlacementWorker(*row[7:])) for row in rows(
        session, "SELECT t.id, t.worker_id, t.kind, t.capacity_bytes, t.used_bytes, t.page_bytes, t.base_addr, "
        "w.id, w.name, w.agent_name, w.epoch FROM tiers t JOIN workers w ON w.id = t.worker_id "
        "WHERE t.kind = ? AND w.state = 'active'", (kind,))]


def insert_blocks(session: Session, blocks: list[tuple]) -> dict[str, int]:
    """(namespace, hash, parent, depth, nbytes, created_at) rows, new; returns hash -> id."""
    ids: dict[str, int] = {}
    for start in range(0, len(blocks), ROWS_PER_INSERT):
        chunk = blocks[start : start + ROWS_PER_INSERT]
        values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, 0)"] * len(chunk))
        params = tuple(x for b in chunk for x in (*b, b[5]))  # last_access = created_at
        ids.update((h, i) for i, h in rows(
            session, "INSERT INTO blocks (namespace_id, hash, parent, depth, nbytes, created_at, last_access, "
            f"hit_count) VALUES {values} RETURNING id, hash", params))
    return ids


def insert_reservations(session: Session, replicas: list[tuple]) -> None:
    """(block id, tier id, epoch, token, pages, reserved bytes, expires_at, created_at) rows, WRITING."""
    driver_many(session, "INSERT INTO replicas (block_id, tier_id, epoch, state, token, pages, reserved_bytes, expires_at, "
         f"created_at) VALUES (?, ?, ?, '{WRITING}', ?, ?, ?, ?, ?)",
         [(b, t, e, tok, json.dumps(pages), n, x, c) for b, t, e, tok, pages, n, x, c in replicas])


def writing_rows(session: Session, token: str) -> list[WritingRow]:
    found = rows(session, "SELECT r.id, r.epoch, r.expires_at, b.id, b.hash, w.epoch, t.id, b.namespace_id, "
                 "b.parent, b.nbytes, r.pages FROM replicas r JOIN blocks b ON b.id = r.block_id "
                 "JOIN tiers t ON t.id = r.tier_id JOIN workers w ON w.id = t.worker_id "
                 f"WHERE r.token = ? AND r.state = '{WRITING}'", (token,))
    return [WritingRow(*row[:10], json.loads(row[10]) if isinstance(row[10], str) else row[10]) for row in found]


def commit_replicas(session: Session, replica_ids: list[int], checksums: dict[int, str]) -> None:
    """WRITING -> READY for `replica_ids`; each block's checksum recorded (block id -> checksum)."""
    for start in range(0, len(replica_ids), CHUNK):
        chunk = replica_ids[start : start + CHUNK]
        rows_changed = f"UPDATE replicas SET state = '{READY}', expires_at = NULL WHERE id IN ({_marks(len(chunk))})"
        connection, sql = driver(session, rows_changed)
        connection.exec_driver_sql(sql, tuple(chunk))
    driver_many(session, "UPDATE blocks SET checksum = ? WHERE id = ?", [(c, b) for b, c in checksums.items()])


def add_used(session: Session, tier_id: int, delta: int) -> None:
    """An atomic `used_bytes = used_bytes + delta` (no read-modify-write)."""
    if delta:
        connection, sql = driver(session, "UPDATE tiers SET used_bytes = used_bytes + ? WHERE id = ?")
        connection.exec_driver_sql(sql, (delta, tier_id))
