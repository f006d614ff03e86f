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
