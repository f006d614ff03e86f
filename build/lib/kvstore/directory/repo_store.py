"""The save path's SQL, straight through the database driver.

complete_store runs these once per save, with one row per block:
SQLAlchemy's per-row parameter processing and ORM loading cost more than
SQLite itself (about 100 µs a block against 10). The statements are
plain SQL that SQLite and PostgreSQL both take; `?` placeholders become `%s`
for drivers that want them.
"""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from kvstore.directory.models.replica import READY
from kvstore.directory.repository import chunks, driver, driver_many

ROWS_PER_INSERT = 500  # rows of one multi-row INSERT: 8 or 9 columns stay under every driver's parameter limit


def rows(session: Session, sql: str, params: tuple = ()) -> list[tuple]:
    connection, sql = driver(session, sql)
    return list(connection.exec_driver_sql(sql, params))


def marks(n: int) -> str:
    return ", ".join("?" * n)


def depths(session: Session, namespace_id: str, hashes: list[str]) -> dict[str, int]:
    """hash -> depth of the blocks the directory has."""
    found: dict[str, int] = {}
    for chunk in chunks(hashes):
        found.update(rows(session, f"SELECT hash, depth FROM blocks WHERE namespace_id = ? AND hash IN "
                          f"({marks(len(chunk))})", (namespace_id, *chunk)))
    return found


def insert_blocks(session: Session, namespace_id: str, blocks: list[tuple], now: float) -> dict[str, int]:
    """(hash, parent, depth, nbytes, checksum) rows, committed; returns hash -> id. A block row that is
    already there (a replica of it is still being deleted) keeps its id and takes the new checksum."""
    ids: dict[str, int] = {}
    for start in range(0, len(blocks), ROWS_PER_INSERT):
        chunk = blocks[start : start + ROWS_PER_INSERT]
        values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, 0)"] * len(chunk))
        params = tuple(x for h, p, d, n, c in chunk for x in (namespace_id, h, p, d, n, c, now, now))
        ids.update((h, i) for i, h in rows(
            session, "INSERT INTO blocks (namespace_id, hash, parent, depth, nbytes, checksum, created_at, "
            f"last_access, hit_count) VALUES {values} ON CONFLICT (namespace_id, hash) DO NOTHING RETURNING id, hash",
            params))
    there = [b for b in blocks if b[0] not in ids]
    if there:
        for chunk in chunks([b[0] for b in there]):
            ids.update((h, i) for h, i in rows(
                session, f"SELECT hash, id FROM blocks WHERE namespace_id = ? AND hash IN ({marks(len(chunk))})",
                (namespace_id, *chunk)))
        driver_many(session, "UPDATE blocks SET checksum = ? WHERE id = ?", [(b[4], ids[b[0]]) for b in there])
    return ids


def insert_replicas(session: Session, replicas: list[tuple]) -> dict[int, int]:
    """(block id, tier id, epoch, token, pages, reserved bytes, created_at) rows, READY; returns block
    id -> replica id."""
    ids: dict[int, int] = {}
    for start in range(0, len(replicas), ROWS_PER_INSERT):
        chunk = replicas[start : start + ROWS_PER_INSERT]
        values = ", ".join([f"(?, ?, ?, '{READY}', ?, ?, ?, NULL, ?)"] * len(chunk))
        params = tuple(x for b, t, e, tok, pages, n, c in chunk for x in (b, t, e, tok, json.dumps(pages), n, c))
        ids.update((b, i) for i, b in rows(
            session, "INSERT INTO replicas (block_id, tier_id, epoch, state, token, pages, reserved_bytes, "
            f"expires_at, created_at) VALUES {values} RETURNING id, block_id", params))
    return ids
