"""replicas: drop the single-column indexes on state and tier_id

Both are the leading column of a composite index, (state, expires_at) and
(tier_id, state), which serves the same queries; every replica written or
changed paid for two more b-trees.

Revision ID: 0004
Revises: 0003
"""
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index('ix_replicas_state', table_name='replicas')
    op.drop_index('ix_replicas_tier_id', table_name='replicas')


def downgrade() -> None:
    op.create_index('ix_replicas_tier_id', 'replicas', ['tier_id'])
    op.create_index('ix_replicas_state', 'replicas', ['state'])
