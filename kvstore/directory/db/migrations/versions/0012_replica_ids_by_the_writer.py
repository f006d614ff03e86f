"""replica ids assigned by the writer

Revision ID: 0012
Revises: 0011

A save inserted its replica rows with RETURNING to learn their ids: the database sent a row back
for each block. The writer, the only one that inserts replicas, numbers them itself as it does
blocks (0010), so the PostgreSQL column loses its sequence; SQLite's rowid needs no change.
"""
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.execute("ALTER TABLE replicas ALTER COLUMN id DROP DEFAULT")
    op.execute("DROP SEQUENCE IF EXISTS replicas_id_seq")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.execute("CREATE SEQUENCE replicas_id_seq OWNED BY replicas.id")
    op.execute("SELECT setval('replicas_id_seq', coalesce((SELECT max(id) FROM replicas), 0) + 1, false)")
    op.execute("ALTER TABLE replicas ALTER COLUMN id SET DEFAULT nextval('replicas_id_seq')")
