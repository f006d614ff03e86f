"""Engine, sessions and migrations. SQLite by default, any SQLAlchemy URL by setting."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from kvstore.core.errors import KVStoreError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"  # shipped inside the package (wheel included)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # transactions are begun below: SAVEPOINTs then work
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA cache_size=-65536")  # 64 MiB of pages: the block index of ~1M blocks
            cursor.execute("PRAGMA temp_store=MEMORY")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN")

        return engine
    # psycopg prepares a statement on the server after 5 runs and PostgreSQL may then keep a generic
    # plan costed for the table as it was (empty at first): a sequential scan for every IN list
    # once the table holds millions of blocks. Planned per execution instead.
    connect_args = {"prepare_threshold": None} if url.startswith("postgresql+psycopg") else {}
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10, connect_args=connect_args)


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at `url` to `revision` by running the alembic migrations."""
    assert MIGRATIONS_DIR.is_dir(), f"migrations not found at {MIGRATIONS_DIR}"
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(config, revision)


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
