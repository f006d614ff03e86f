"""namespaces.write_through: keep a copy of every block in S3

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("namespaces", recreate="never") as batch_op:  # in place: a rebuild cascades deletes
        batch_op.add_column(sa.Column("write_through", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("namespaces", recreate="never") as batch_op:  # in place: a rebuild cascades deletes
        batch_op.drop_column("write_through")
