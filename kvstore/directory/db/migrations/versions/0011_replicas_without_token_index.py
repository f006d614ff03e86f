"""replicas without the index on token

Revision ID: 0011
Revises: 0010

Every replica a save inserts paid for an entry in it; the statements that name a token (a move's
expired or orphaned destinations) also ask for WRITING replicas, which the (state, expires_at)
index finds: saves' reservations live in memory, so WRITING rows are only moves' destinations.
"""
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_replicas_token", "replicas")


def downgrade() -> None:
    op.create_index("ix_replicas_token", "replicas", ["token"])
