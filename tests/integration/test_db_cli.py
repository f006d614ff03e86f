"""`kvstore db`: where the schema is (current, history), upgrades, and online SQLite backups."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from kvstore.directory.db import engine as db
from tests.integration.test_cli import cli

VERSIONS = Path(db.MIGRATIONS_DIR) / "versions"


def test_current_and_history_say_where_the_schema_is(tmp_path):
    url = f"sqlite:///{tmp_path / 'directory.db'}"
    fresh = cli("db", "current", "--database-url", url)
    assert fresh.returncode == 0 and "no schema yet" in fresh.stdout, fresh.stderr
    history = json.loads(cli("db", "history", "--database-url", url, "-o", "json").stdout)
    assert len(history) == len(list(VERSIONS.glob("0*.py"))) and not any(r["applied"] for r in history)
    assert all(r["title"] for r in history)
    assert cli("db", "upgrade", "--database-url", url).returncode == 0
    now = json.loads(cli("db", "current", "--database-url", url, "-o", "json").stdout)
    assert now["current"] == now["head"] == history[-1]["revision"]
    assert all(r["applied"] for r in json.loads(cli("db", "history", "--database-url", url, "-o", "json").stdout))
    assert "(head)" in cli("db", "current", "--database-url", url).stdout


def test_a_backup_is_a_consistent_copy_taken_while_the_database_is_written(tmp_path):
    path = tmp_path / "directory.db"
    url = f"sqlite:///{path}"
    assert cli("db", "upgrade", "--database-url", url).returncode == 0
    writer = sqlite3.connect(path, check_same_thread=False)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE filler (i INTEGER PRIMARY KEY, pad TEXT)")
    stop = threading.Event()

    def write():
        while not stop.is_set():
            with writer:  # one transaction of 100 rows
                writer.executemany("INSERT INTO filler (pad) VALUES (?)", [("x" * 200,)] * 100)
    thread = threading.Thread(target=write)
    thread.start()
    try:
        copy = tmp_path / "backup.db"
        done = cli("db", "backup", str(copy), "--database-url", url, "-o", "json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["bytes"] == copy.stat().st_size > 0
    finally:
        stop.set()
        thread.join()
        writer.close()
    with sqlite3.connect(copy) as backup:
        assert backup.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert backup.execute("SELECT count(*) % 100 FROM filler").fetchone() == (0,)  # whole transactions only
        assert backup.execute("SELECT version_num FROM alembic_version").fetchone()[0] == db.schema(url)["head"]
    again = cli("db", "backup", str(copy), "--database-url", url)
    assert again.returncode == 1 and "never overwrites" in again.stderr  # an existing file is kept
    postgres = cli("db", "backup", str(tmp_path / "pg.dump"), "--database-url", "postgresql+psycopg://u@h/db")
    assert postgres.returncode == 1 and "pg_dump" in postgres.stderr and "Traceback" not in postgres.stderr
    missing = cli("db", "backup", str(tmp_path / "x.db"), "--database-url", f"sqlite:///{tmp_path / 'nope.db'}")
    assert missing.returncode == 1 and "no SQLite database" in missing.stderr
