"""SQL straight through the database driver, for the paths that handle a row per block.

    connection, sql = driver(session, sql)      # `?` placeholders, as the driver wants them
    rows(session, sql, params) / execute(session, sql, params) / driver_many(session, sql, rows)
    stream(session, sql, params, size)          # a large read, `size` rows at a time
    insert_blocks                               # multi-row INSERTs, ids assigned here
    insert_replicas                             # multi-row INSERTs, ids assigned here
    set_states(session, {replica id: state})
    expire_loaded(session, model, ids)          # after a driver UPDATE of rows the ORM may hold

Saves, loads and tier moves run their per-block statements here: SQLAlchemy's per-row parameter
processing and ORM objects cost more than SQLite itself (about 100 µs a block against 10). The
statements are plain SQL that SQLite and PostgreSQL both take. Pending ORM changes are flushed
before each statement, so it runs after them.

Statements that name rows (by id, by hash, by token) filter on nothing else that an index covers
(a replica's state or tier): they read that column and the caller compares it. SQLite plans without
statistics and takes an equality on any indexed column for about ten rows, so `state IN (...) AND
id IN (...)` walked the state index, every READY replica, instead of the ids: a load's pin, an
eviction's victims and the index's read-back each did work in proportion to the table, not to the
blocks named (tests/component/test_sql_work.py).
"""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from kvstore.directory.db.engine import driver_cursor, on_driver
from kvstore.directory.db.models import Replica
from kvstore.directory.db.models.replica import READY

CHUNK = 500  # ids per IN list: PostgreSQL takes at most 65,535 parameters a statement
ROWS_PER_INSERT = 500  # rows of one multi-row INSERT: 8 or 9 columns stay under every driver's parameter limit


def chunks(values: list) -> list[list]:
    return [values[i : i + CHUNK] for i in range(0, len(values), CHUNK)]


def driver(session: Session, sql: str, writes: bool = True) -> tuple:
    """The session's connection and `sql` (`?` placeholders) as its driver wants it, to run straight
    through the driver: not compiled again, no parameters processed per row (SQLAlchemy Core costs
    about ten microseconds a row). Pending ORM changes are flushed first, as `session.execute` would,
    so the statement runs after them."""
    session.flush()
    if writes:
        session.info["wrote"] = True  # for the writer: this group has something to commit (`writer.py`)
    connection = session.connection()
    return connection, _placeholders(connection, sql)


def _placeholders(connection, sql: str) -> str:
    """`sql`'s `?` placeholders as the connection's driver wants them."""
    return sql.replace("?", "%s") if connection.dialect.paramstyle in ("format", "pyformat") else sql


def shrink(session: Session) -> None:
    """A SQLite connection that read a whole tier gives its page cache back (it stays with the
    connection in the pool otherwise: up to the cache size, 64 MiB, per connection)."""
    connection = session.connection()
    if connection.dialect.name == "sqlite":
        connection.exec_driver_sql("PRAGMA shrink_memory")


def execute(session: Session, sql: str, params: tuple = ()) -> None:
    """One statement that returns no rows, through the driver."""
    _cursor_run(session, sql, params)


def driver_many(session: Session, sql: str, rows: list[tuple]) -> None:
    """One statement for many rows (executemany) through the driver."""
    if rows:
        _cursor_run(session, sql, rows, many=True)


def rows(session: Session, sql: str, params: tuple = ()) -> list[tuple]:
    """The rows as the driver's tuples (no result rows built over them: a save reads two per block)."""
    return _cursor_run(session, sql, params, fetch=True)


def _cursor_run(session: Session, sql: str, params, many: bool = False, fetch: bool = False):
    """`sql` on a cursor of the session's DBAPI connection, in its transaction (`engine.on_driver`).
    SQLAlchemy's own execution (`exec_driver_sql`) cost 20-50 µs a statement here, where the driver
    takes 2-3: a save runs about six."""
    connection, sql = driver(session, sql)
    return on_driver(connection, sql, params, many, fetch)


def stream(session: Session, sql: str, params: tuple = (), size: int = 20_000):
    """A large read's rows as the driver's tuples, `size` at a time (the index's rebuild: no SQLAlchemy
    row or type processing per row). On PostgreSQL a server-side cursor: the rows are never all in
    this process at once. Errors as `engine.on_driver` raises them; pending ORM changes flushed first."""
    connection, sql = driver(session, sql, writes=False)
    name = "kvstore_stream" if connection.dialect.name == "postgresql" else None
    with driver_cursor(connection, sql, params, name=name) as cursor:
        cursor.execute(sql, params)
        while batch := cursor.fetchmany(size):
            yield batch


def marks(n: int) -> str:
    return ", ".join("?" * n)


def insert_blocks(session: Session, namespace_id: str, blocks: list[tuple], now: float,
                  there: dict[str, int] | None = None) -> dict[str, int]:
    """(hash, parent, depth, nbytes, checksum) rows, committed; returns hash -> id. `there`: hash -> id
    of the blocks the lookup index holds already (a row whose replicas cannot be read now): such a
    row keeps its id and takes the new checksum. No SQL asks whether a hash is there: no index
    answers that (`models/block.py`); a row the index does not know of is inserted again, and a
    rebuild from SQL resolves the duplicates."""
    kept = still_there(session, there or {})
    new = [b for b in blocks if b[0] not in kept]
    first = next_block_id(session)
    ids = {**kept, **{b[0]: first + k for k, b in enumerate(new)}}
    for start in range(0, len(new), ROWS_PER_INSERT):  # one statement, not an executemany: a row costs
        chunk = new[start : start + ROWS_PER_INSERT]  # SQLite's driver about 0.4 µs less (bench/sql_floor.py)
        values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, 0)"] * len(chunk))
        execute(session, "INSERT INTO blocks (id, namespace_id, hash, parent, depth, nbytes, checksum, created_at, "
                f"last_access, hit_count) VALUES {values}", tuple(
                    x for k, (h, p, d, n, c) in enumerate(chunk, first + start)
                    for x in (k, namespace_id, h, p, d, n, c, now, now)))
    driver_many(session, "UPDATE blocks SET checksum = ? WHERE id = ?",
                [(b[4], kept[b[0]]) for b in blocks if b[0] in kept])
    return ids


def next_block_id(session: Session) -> int:
    """The first free block id. The writer assigns them (a save's rows need no RETURNING); asked in
    its own transaction, where it is the only writer, each time: never stale after a change of
    leader, and an index's last entry costs nothing to read."""
    return rows(session, "SELECT coalesce(max(id), 0) + 1 FROM blocks")[0][0]


def still_there(session: Session, there: dict[str, int]) -> dict[str, int]:
    """The entries of `there` whose row is still there (this transaction may have deleted one)."""
    ids = list(there.values())
    found = {i for chunk in chunks(ids) for i, in rows(session, f"SELECT id FROM blocks WHERE id IN "
                                                         f"({marks(len(chunk))})", tuple(chunk))}
    return {h: i for h, i in there.items() if i in found}


def insert_replicas(session: Session, replicas: list[tuple], state: str = READY,
                    expires_at: float | None = None) -> dict[int, int]:
    """(block id, tier id, epoch, token, pages, reserved bytes, created_at) rows, in `state` (READY, or
    WRITING with `expires_at` for a move's destinations); returns block id -> replica id. The writer
    numbers them (no row comes back per replica), as it does blocks."""
    first = rows(session, "SELECT coalesce(max(id), 0) + 1 FROM replicas")[0][0] if replicas else 0
    for start in range(0, len(replicas), ROWS_PER_INSERT):
        chunk = replicas[start : start + ROWS_PER_INSERT]
        values = ", ".join([f"(?, ?, ?, ?, '{state}', ?, ?, ?, ?, ?)"] * len(chunk))
        execute(session, "INSERT INTO replicas (id, block_id, tier_id, epoch, state, token, pages, reserved_bytes, "
                f"expires_at, created_at) VALUES {values}", tuple(
                    x for k, (b, t, e, tok, pages, n, c) in enumerate(chunk, first + start)
                    for x in (k, b, t, e, tok, _json_runs(pages), n, expires_at, c)))
    return {r[0]: first + k for k, r in enumerate(replicas)}


def _json_runs(pages) -> str:
    """[[first, count], ...] as JSON text (as `json.dumps` writes it; one run spelled out directly)."""
    if len(pages) == 1:
        first, count = pages[0]
        return f"[[{int(first)}, {int(count)}]]"
    return json.dumps(pages)


def set_states(session: Session, states: dict[int, str]) -> None:
    """replica id -> its new state (READY, MOVING or DELETING: none of them expires). A replica this
    session holds as an ORM object is expired, so what it reads next is the new state."""
    driver_many(session, "UPDATE replicas SET state = ?, expires_at = NULL WHERE id = ?",
                [(state, replica_id) for replica_id, state in states.items()])
    expire_loaded(session, Replica, states)


def set_pages(session: Session, pages: dict[int, tuple[str, list]]) -> None:
    """replica id -> (its token, its pages [[first, count], ...]): where the worker put a move's NVMe
    destination. Only a WRITING row of that token takes them."""
    driver_many(session, "UPDATE replicas SET pages = ? WHERE id = ? AND token = ? AND state = 'writing'",
                [(_json_runs(runs), replica_id, token) for replica_id, (token, runs) in pages.items()])
    expire_loaded(session, Replica, pages, ["pages"])


def expire_loaded(session: Session, model, ids, attributes: list[str] | None = None) -> None:
    """Rows of `model` the driver just changed: the ones this session holds as ORM objects are
    expired (those `attributes`, or all), so what they read next is the database's. The shorter of
    the two is walked: a job that changes 256 replicas usually holds a few ORM objects or none, and
    an identity key costs microseconds to build."""
    held = session.identity_map
    if not held:
        return
    ids = ids if hasattr(ids, "__len__") else list(ids)
    if len(held) < len(ids):
        wanted = ids if isinstance(ids, (set, dict)) else set(ids)
        loaded = [obj for (cls, pk, *_), obj in list(held.items()) if cls is model and pk[0] in wanted]
    else:
        loaded = [obj for obj in (held.get(session.identity_key(model, key)) for key in ids) if obj is not None]
    for obj in loaded:
        session.expire(obj, attributes)


def json_value(value):
    """A JSON column as read through the driver: SQLite gives its text, psycopg the value."""
    return json.loads(value) if isinstance(value, str) else value


def runs_value(value) -> list:
    """A replica's pages as read through the driver: json_value, with one run (`[[first, count]]`, as
    `_json_runs` and `json.dumps` write it: most blocks) read without the JSON parser."""
    if isinstance(value, str) and value.count("[") == 2:
        first, count = value[2:-2].split(",")
        return [(int(first), int(count))]
    return json_value(value)
