"""directory_leader (who leads, its term), changes (the leader's commits, for the other replicas),
namespaces.replicas (workers that hold each block)

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    leader = op.create_table(
        "directory_leader",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
        sa.Column("pruned_below", sa.BigInteger(), nullable=False),
    )
    op.bulk_insert(leader, [{"id": 1, "term": 0, "url": "", "since": 0.0, "pruned_below": 0}])
    op.create_table(
        "changes",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("blocks", sa.Text(), nullable=False),
        sa.Column("topology", sa.Boolean(), nullable=False),
        sa.Column("namespaces", sa.Boolean(), nullable=False),
    )
    with op.batch_alter_table("namespaces", recreate="never") as batch_op:  # in place: a rebuild cascades deletes
        batch_op.add_column(sa.Column("replicas", sa.Integer(), server_default="1", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("namespaces", recreate="never") as batch_op:  # in place: a rebuild cascades deletes
        batch_op.drop_column("replicas")
    op.drop_table("changes")
    op.drop_table("directory_leader")
