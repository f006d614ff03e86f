"""tiers.device (the CUDA device of an HBM tier; 0 for the others)

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tiers", sa.Column("device", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN in place (SQLite 3.35+): a batch table rebuild would drop `tiers`,
    # and with foreign keys on, every replica and grant row with it (ON DELETE CASCADE)
    with op.batch_alter_table("tiers", recreate="never") as batch:
        batch.drop_column("device")
