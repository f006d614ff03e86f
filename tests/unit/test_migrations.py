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


def _populate(url: str, rows: list[str]) -> None:
    from kvstore.directory.db.engine import make_engine

    engine = make_engine(url)  # the directory's own connection settings: foreign keys on
    with engine.begin() as connection:
        for sql in rows:
            connection.exec_driver_sql(sql)
    engine.dispose()


TOPOLOGY = ["INSERT INTO namespaces (id, spec, created_at) VALUES ('ns', '{}', 0)",
            "INSERT INTO workers (id, name, agent_name, agent_metadata, epoch, state, pid, control_url, backends, "
            "heartbeat_at, registered_at, owner) VALUES (1, 'w', 'a', '', 1, 'active', 1, '', '[]', 0, 0, '')",
            "INSERT INTO tiers (id, worker_id, kind, capacity_bytes, used_bytes, page_bytes, base_addr, device, "
            "high_watermark, low_watermark) VALUES (1, 1, 'dram', 4096, 0, 4096, 0, 0, 0.9, 0.8)"]


def _block(block_id: int, block_hash: str, replicas: int) -> list[str]:
    return [f"INSERT INTO blocks (id, namespace_id, hash, depth, nbytes, checksum, created_at, last_access, hit_count) "
            f"VALUES ({block_id}, 'ns', '{block_hash}', 0, 4096, '0123456789abcdef', 0, 0, 0)"] + [
            f"INSERT INTO replicas (id, block_id, tier_id, epoch, state, token, pages, reserved_bytes, created_at) "
            f"VALUES ({block_id}{k}, {block_id}, 1, 1, 'ready', 't', '[[{block_id}{k}, 1]]', 4096, 0)"
            for k in range(replicas)]  # numbered as the writer numbers them (0012: no sequence on PostgreSQL)


def test_0010_drops_the_hash_index_of_a_populated_database_and_taking_it_back_keeps_every_replica(tmp_path):
    round_trip_0010(f"sqlite:///{tmp_path / 'directory.db'}")


def round_trip_0010(url: str) -> None:
    """Up: SQLite copies the blocks table without its unique (namespace, hash) index, foreign keys off
    (with them on, dropping the old table deleted every replica). Down: duplicate rows saved meanwhile
    give their replicas to the newest row of their hash before the index comes back. (PostgreSQL:
    tests/component/test_schema.py.)"""
    from alembic import command
    from sqlalchemy import inspect

    from kvstore.directory.db.engine import _alembic

    def read(sql: str) -> list[tuple]:
        engine = create_engine(url)
        with engine.connect() as connection:
            found = [tuple(row) for row in connection.exec_driver_sql(sql)]
        engine.dispose()
        return found

    def unique_on_hash() -> bool:
        engine = create_engine(url)
        found = inspect(engine).get_unique_constraints("blocks") + \
            [i for i in inspect(engine).get_indexes("blocks") if i["unique"]]
        engine.dispose()
        return any(c["column_names"] == ["namespace_id", "hash"] for c in found)

    upgrade(url, "0009")
    _populate(url, TOPOLOGY + _block(1, "aa", 2) + _block(2, "bb", 1))
    upgrade(url)
    assert read("SELECT id, hash FROM blocks ORDER BY id") == [(1, "aa"), (2, "bb")]
    assert read("SELECT count(*) FROM replicas") == [(3,)] and not unique_on_hash()
    _populate(url, _block(7, "aa", 1) + _block(9, "aa", 1))  # saved twice more while its rows held no readable replica
    command.downgrade(_alembic(url), "0009")
    assert read("SELECT id, hash FROM blocks ORDER BY id") == [(2, "bb"), (9, "aa")] and unique_on_hash()
    assert read("SELECT block_id, count(*) FROM replicas GROUP BY block_id ORDER BY block_id") == [(2, 1), (9, 4)]
    _populate(url, ["INSERT INTO blocks (namespace_id, hash, depth, nbytes, created_at, last_access, hit_count) "
                    "VALUES ('ns', 'cc', 0, 1, 0, 0, 0)"])  # 0009's database numbers blocks itself again
    assert read("SELECT max(id) FROM blocks") == [(10,)]
    upgrade(url)
    assert read("SELECT count(*) FROM replicas") == [(5,)] and not unique_on_hash()
