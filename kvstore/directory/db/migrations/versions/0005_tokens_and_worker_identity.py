"""tokens (scoped bearer credentials, hashed); workers.owner and workers.control_secret

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
    )
    with op.batch_alter_table("workers", recreate="never") as batch_op:  # in place: a rebuild cascades deletes
        batch_op.add_column(sa.Column("owner", sa.String(64), server_default="", nullable=False))
        batch_op.add_column(sa.Column("control_secret", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", recreate="never") as batch_op:  # in place: a rebuild cascades deletes
        batch_op.drop_column("control_secret")
        batch_op.drop_column("owner")
    op.drop_table("tokens")
