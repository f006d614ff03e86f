"""commit_marks (one row per group commit: whether a COMMIT whose answer was lost happened)

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "commit_marks",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("at", sa.Float(), nullable=False),
    )
    op.create_index("ix_commit_marks_at", "commit_marks", ["at"])


def downgrade() -> None:
    op.drop_index("ix_commit_marks_at", "commit_marks")
    op.drop_table("commit_marks")
