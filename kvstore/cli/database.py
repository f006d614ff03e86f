"""`kvstore db`: the directory database's schema (upgrade, current, history) and SQLite backups."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstore.cli.common import Output, emit, one_line_errors

db_app = typer.Typer(help="The directory's database: schema migrations and backups.", no_args_is_help=True)
DatabaseUrl = Annotated[str, typer.Option(envvar="KVSTORE_DATABASE_URL", help="the directory's database")]
DEFAULT_DATABASE = "sqlite:///var/directory.db"


@db_app.command("upgrade")
@one_line_errors
def db_upgrade(database_url: DatabaseUrl = DEFAULT_DATABASE, output: Output = "table") -> None:
    """Run the alembic migrations up to the newest revision."""
    from kvstore.core.config import redact_url
    from kvstore.directory.db import engine as db

    db.upgrade(database_url)
    emit(output, {"database_url": redact_url(database_url), "schema": "head"}, text="schema is at head")


@db_app.command("current")
@one_line_errors
def db_current(database_url: DatabaseUrl = DEFAULT_DATABASE, output: Output = "table") -> None:
    """The schema revision the database is at, and whether it is this kvstore's newest."""
    from kvstore.directory.db import engine as db

    state = db.schema(database_url)
    current, head = state["current"], state["head"]
    text = "no schema yet: kvstore db upgrade" if current is None else \
        f"{current} (head)" if current == head else f"{current}; this kvstore's head is {head}: kvstore db upgrade"
    emit(output, {"current": current, "head": head}, text=text)


@db_app.command("history")
@one_line_errors
def db_history(database_url: DatabaseUrl = DEFAULT_DATABASE, output: Output = "table") -> None:
    """Every migration this kvstore has, oldest first, and which the database has applied."""
    from kvstore.directory.db import engine as db

    history = db.schema(database_url)["history"]

    def table() -> Table:
        t = Table("revision", "migration", "applied")
        for row in history:
            t.add_row(row["revision"], row["title"], "yes" if row["applied"] else "no")
        return t
    emit(output, history, table)


@db_app.command("backup")
@one_line_errors
def db_backup(path: Annotated[Path, typer.Argument(help="the backup file to write (never overwritten)")],
              database_url: DatabaseUrl = DEFAULT_DATABASE, output: Output = "table") -> None:
    """An online copy of a SQLite database, consistent while the directory runs. For PostgreSQL,
    pg_dump (docs/operations.md)."""
    from kvstore.directory.db import engine as db

    size = db.backup(database_url, path)
    emit(output, {"path": str(path), "bytes": size}, text=f"backed up to {path} ({size} bytes)")
