"""Engine, sessions and migrations. SQLite by default, any SQLAlchemy URL by setting."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from kvstore.core.errors import KVStoreError

# the SQLAlchemy types too: the rest of the directory names them from here
__all__ = ["Engine", "Session", "sessionmaker", "make_engine", "make_sessions", "on_driver", "driver_cursor",
           "upgrade", "schema", "backup", "unreachable", "outage"]

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"  # shipped inside the package (wheel included)
SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA foreign_keys=ON",
    "PRAGMA synchronous=NORMAL",  # WAL: a commit writes the log, only a checkpoint syncs the file
    "PRAGMA cache_size=-65536",  # 64 MiB of pages: the block index of ~1M blocks
    "PRAGMA temp_store=MEMORY",
    # The commit that crosses the WAL's size copies it into the database and syncs it, on the
    # writer's thread: 16 MiB (from 4) makes that a quarter as often, while a WAL stays small
    # enough to read through.
    "PRAGMA wal_autocheckpoint=4000",
)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # transactions are begun below: SAVEPOINTs then work
            cursor = dbapi_conn.cursor()
            for pragma in SQLITE_PRAGMAS:
                cursor.execute(pragma)
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):  # straight to the driver: SQLAlchemy's execution costs ten times SQLite's BEGIN
            on_driver(conn, "BEGIN", ())

        return engine
    # psycopg prepares a statement on the server after 5 runs and PostgreSQL may then keep a generic
    # plan costed for the table as it was (empty at first): a sequential scan for every IN list
    # once the table holds millions of blocks. Planned per execution instead.
    connect_args = {"prepare_threshold": None} if url.startswith("postgresql+psycopg") else {}
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10, connect_args=connect_args)


def on_driver(connection, sql: str, params, many: bool = False, fetch: bool = False):
    """`sql` on a cursor of `connection`'s DBAPI connection (in its transaction), past SQLAlchemy's
    execution (`driver_cursor`); the rows when `fetch`."""
    with driver_cursor(connection, sql, params, many) as cursor:
        (cursor.executemany if many else cursor.execute)(sql, params)
        return cursor.fetchall() if fetch else None


@contextmanager
def driver_cursor(connection, sql: str, params, many: bool = False, name: str | None = None):
    """A cursor of `connection`'s DBAPI connection (a server-side one called `name` on PostgreSQL),
    for `sql` with `params`. What the driver raises in it is raised as SQLAlchemy raises it
    (`DBAPIError` and its kinds, which `outage` reads), and a connection the driver reports lost is
    invalidated, as is one interrupted mid-statement; SQLAlchemy's execution events and statement
    logging do not see it."""
    dialect, cursor = connection.dialect, None
    try:
        raw = connection.connection.driver_connection
        cursor = raw.cursor(name=name) if name else raw.cursor()
        yield cursor
    except dialect.loaded_dbapi.Error as exc:
        lost = dialect.is_disconnect(exc, connection.connection.dbapi_connection, cursor)
        if lost:
            connection.invalidate(exc)
        raise DBAPIError.instance(sql, params, exc, dialect.loaded_dbapi.Error,
                                  hide_parameters=connection.engine.hide_parameters, connection_invalidated=lost,
                                  dialect=dialect, ismulti=many) from exc
    except BaseException as exc:
        if not isinstance(exc, (Exception, GeneratorExit)):  # interrupted: the connection's state is unknown
            connection.invalidate(exc)  # (a reader that stops early closes its stream: not an interruption)
        raise
    finally:
        if cursor is not None and not connection.invalidated:
            cursor.close()


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at `url` to `revision` by running the alembic migrations."""
    command.upgrade(_alembic(url), revision)


def _alembic(url: str) -> Config:
    assert MIGRATIONS_DIR.is_dir(), f"migrations not found at {MIGRATIONS_DIR}"
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def schema(url: str) -> dict:
    """{"current": the revision the database is at (None: no schema yet), "head": the newest this
    kvstore has, "history": [{"revision", "title", "applied"}] oldest first}."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(_alembic(url))
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except DBAPIError as exc:
        raise KVStoreError("unavailable", f"cannot read the database's schema: {exc.orig}") from None
    finally:
        engine.dispose()
    revisions = list(reversed(list(scripts.walk_revisions())))
    applied = {r.revision for r in scripts.iterate_revisions(current, "base")} if current else set()
    return {"current": current, "head": scripts.get_current_head(),
            "history": [{"revision": r.revision, "title": (r.doc or "").splitlines()[0] if r.doc else "",
                         "applied": r.revision in applied} for r in revisions]}


def backup(url: str, path: Path) -> int:
    """An online copy of a SQLite database at `path` (SQLite's backup API: consistent while the
    directory keeps writing); its size in bytes. PostgreSQL is backed up with pg_dump."""
    import sqlite3

    if not url.startswith("sqlite:///"):
        raise KVStoreError("invalid", "kvstore db backup copies SQLite databases; for PostgreSQL run "
                           "pg_dump --format=custom --file PATH DATABASE (see docs/operations.md)")
    source = Path(url.removeprefix("sqlite:///"))
    if not source.is_file():
        raise KVStoreError("not_found", f"no SQLite database at {source}")
    if path.exists():
        raise KVStoreError("conflict", f"{path} exists: give a new path (a backup never overwrites)")
    src, dst = sqlite3.connect(source), sqlite3.connect(path)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return path.stat().st_size


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be reached now (a connection refused, dropped, or the
    server restarting): an outage to answer with 503, not a bug."""
    return isinstance(exc, (OperationalError, InterfaceError, DisconnectionError)) or \
        (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def outage(exc: BaseException) -> KVStoreError | None:
    """The answer to an error a call raised: the directory's own error for a database outage, else
    None (a bug, answered with 500)."""
    if unreachable(exc):
        return KVStoreError("unavailable", "the database does not answer; try again shortly",
                            cause=type(exc).__name__)
    return None
