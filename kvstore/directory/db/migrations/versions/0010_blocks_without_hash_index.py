"""blocks without the unique index on (namespace_id, hash); block ids assigned by the writer

Revision ID: 0010
Revises: 0009

The leader's lookup index decides whether a block is there; a save asks it, not SQL. Each saved
block's entry in that index (a random hash) was the dearest part of a save's INSERT. The leader
assigns block ids itself (one executemany, no RETURNING), so the PostgreSQL column loses its
sequence. Going back resolves duplicate rows first: the newest row of a (namespace, hash) keeps
every replica of the others, which are deleted.
"""
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

COLUMNS = "id, namespace_id, hash, parent, depth, nbytes, checksum, created_at, last_access, hit_count"
PG_UNIQUE = "blocks_namespace_id_hash_key"  # PostgreSQL's name for 0001's unnamed constraint


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        _rebuild_blocks(bind, unique=False)
        return
    op.drop_constraint(PG_UNIQUE, "blocks", type_="unique")
    op.execute("ALTER TABLE blocks ALTER COLUMN id DROP DEFAULT")
    op.execute("DROP SEQUENCE IF EXISTS blocks_id_seq")


def downgrade() -> None:
    bind = op.get_bind()
    _merge_duplicates()
    if bind.dialect.name == "sqlite":
        _rebuild_blocks(bind, unique=True)
        return
    op.create_unique_constraint(PG_UNIQUE, "blocks", ["namespace_id", "hash"])
    op.execute("CREATE SEQUENCE blocks_id_seq OWNED BY blocks.id")
    op.execute("SELECT setval('blocks_id_seq', coalesce((SELECT max(id) FROM blocks), 0) + 1, false)")
    op.execute("ALTER TABLE blocks ALTER COLUMN id SET DEFAULT nextval('blocks_id_seq')")


def _merge_duplicates() -> None:
    """Rows of one (namespace, hash) but the newest give their replicas to it and go."""
    op.execute("CREATE TEMPORARY TABLE block_dups AS SELECT b.id AS old_id, m.new_id FROM blocks b JOIN "
               "(SELECT namespace_id, hash, max(id) AS new_id FROM blocks GROUP BY namespace_id, hash "
               "HAVING count(*) > 1) m ON m.namespace_id = b.namespace_id AND m.hash = b.hash WHERE b.id <> m.new_id")
    op.execute("UPDATE replicas SET block_id = (SELECT new_id FROM block_dups WHERE old_id = replicas.block_id) "
               "WHERE block_id IN (SELECT old_id FROM block_dups)")
    op.execute("DELETE FROM blocks WHERE id IN (SELECT old_id FROM block_dups)")
    op.execute("DROP TABLE block_dups")


def _rebuild_blocks(bind, unique: bool) -> None:
    """SQLite drops a table constraint only by copying the table. Foreign keys go off meanwhile: with
    them on, dropping the old table deletes every replica (ON DELETE CASCADE)."""
    with _foreign_keys_off(bind):
        op.create_table(
            "blocks_new",
            sa.Column("id", sa.Integer(), nullable=False),
            sa.Column("namespace_id", sa.String(length=16), nullable=False),
            sa.Column("hash", sa.String(length=128), nullable=False),
            sa.Column("parent", sa.String(length=128), nullable=True),
            sa.Column("depth", sa.Integer(), nullable=False),
            sa.Column("nbytes", sa.BigInteger(), nullable=False),
            sa.Column("checksum", sa.String(length=16), nullable=True),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("last_access", sa.Float(), nullable=False),
            sa.Column("hit_count", sa.Integer(), nullable=False),
            sa.ForeignKeyConstraint(["namespace_id"], ["namespaces.id"]),
            sa.PrimaryKeyConstraint("id"),
            *([sa.UniqueConstraint("namespace_id", "hash")] if unique else []))
        op.execute(f"INSERT INTO blocks_new ({COLUMNS}) SELECT {COLUMNS} FROM blocks")
        op.execute("DROP TABLE blocks")
        op.execute("ALTER TABLE blocks_new RENAME TO blocks")
        broken = bind.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        assert not broken, f"rows whose foreign key lost its row: {broken[:5]}"


@contextmanager
def _foreign_keys_off(bind):
    """The pragma is ignored inside a transaction: the migration's is committed and begun again
    around it (alembic commits the last one, with the new revision)."""
    bind.exec_driver_sql("COMMIT")
    bind.exec_driver_sql("PRAGMA foreign_keys=OFF")
    bind.exec_driver_sql("BEGIN")
    try:
        yield
    finally:
        bind.exec_driver_sql("COMMIT")
        bind.exec_driver_sql("PRAGMA foreign_keys=ON")
        bind.exec_driver_sql("BEGIN")
