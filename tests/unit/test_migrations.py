"""The migrations build exactly the schema the models declare (tables, columns, indexes)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from kvstore.directory.db.engine import upgrade
from kvstore.directory.db.models.base import Base


def test_the_migrated_schema_is_the_models_schema(tmp_path):
    url = f"sqlite:///{tmp_path / 'directory.db'}"
    upgrade(url)
    engine = create_engine(url)
    with engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert differences == []


def test_taking_migrations_back_keeps_every_replica(tmp_path):
    """Downgrades drop columns in place: rebuilding a table (alembic's batch mode on SQLite) drops it,
    and with foreign keys on, that deleted every replica and grant of `tiers` (0009) or failed on
    `namespaces` (0006)."""
    import sqlite3

    from alembic import command

    from kvstore.directory.db.engine import _alembic, make_engine

    url = f"sqlite:///{tmp_path / 'directory.db'}"
    upgrade(url)
    engine = make_engine(url)  # the directory's own connection settings: foreign keys on
    with engine.begin() as connection:
        for sql in ("INSERT INTO namespaces (id, spec, created_at) VALUES ('ns', '{}', 0)",
                    "INSERT INTO workers (id, name, agent_name, agent_metadata, epoch, state, pid, control_url, "
                    "backends, heartbeat_at, registered_at, owner) "
                    "VALUES (1, 'w', 'a', x'00', 1, 'active', 1, '', '[]', 0, 0, '')",
                    "INSERT INTO tiers (id, worker_id, kind, capacity_bytes, used_bytes, page_bytes, base_addr, "
                    "device, high_watermark, low_watermark) VALUES (1, 1, 'hbm', 4096, 0, 4096, 0, 3, 0.9, 0.8)",
                    "INSERT INTO blocks (id, namespace_id, hash, depth, nbytes, checksum, created_at, last_access, "
                    "hit_count) VALUES (1, 'ns', 'aa', 0, 4096, '0123456789abcdef', 0, 0, 0)",
                    "INSERT INTO replicas (block_id, tier_id, epoch, state, token, pages, reserved_bytes, created_at) "
                    "VALUES (1, 1, 1, 'ready', 't', '[[0, 1]]', 4096, 0)"):
            connection.exec_driver_sql(sql)
    engine.dispose()
    command.downgrade(_alembic(url), "0008")
    with sqlite3.connect(tmp_path / "directory.db") as db:
        assert db.execute("SELECT count(*) FROM replicas").fetchone() == (1,)
        assert "device" not in {row[1] for row in db.execute("PRAGMA table_info(tiers)")}
    command.downgrade(_alembic(url), "0001")
    with sqlite3.connect(tmp_path / "directory.db") as db:
        assert db.execute("SELECT count(*) FROM replicas").fetchone() == (1,)
    upgrade(url)
    with sqlite3.connect(tmp_path / "directory.db") as db:
        assert db.execute("SELECT device FROM tiers").fetchall() == [(0,)]
