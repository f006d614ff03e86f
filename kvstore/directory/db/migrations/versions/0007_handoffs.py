"""handoffs (a producer's word that a hand-off's saves committed), changes.handoffs (which ones a
group commit of the leader wrote, for the other replicas)

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "handoffs",
        sa.Column("namespace_id", sa.String(16), primary_key=True),
        sa.Column("handoff_id", sa.String(128), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("committed_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_handoffs_committed_at", "handoffs", ["committed_at"])
    with op.batch_alter_table("changes") as batch_op:
        batch_op.add_column(sa.Column("handoffs", sa.Text(), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("changes") as batch_op:
        batch_op.drop_column("handoffs")
    op.drop_index("ix_handoffs_committed_at", "handoffs")
    op.drop_table("handoffs")
