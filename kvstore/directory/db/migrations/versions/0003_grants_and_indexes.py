"""page grants; indexes the reaper and eviction need

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('grants',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tier_id', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('token', sa.String(length=64), nullable=False),
    sa.Column('runs', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['tier_id'], ['tiers.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_grants_tier_id', 'grants', ['tier_id'])
    op.create_index('ix_leases_expires_at', 'leases', ['expires_at'])
    op.create_index('ix_replicas_tier_id_state', 'replicas', ['tier_id', 'state'])
    op.create_index('ix_replicas_state_expires_at', 'replicas', ['state', 'expires_at'])


def downgrade() -> None:
    op.drop_index('ix_replicas_state_expires_at', table_name='replicas')
    op.drop_index('ix_replicas_tier_id_state', table_name='replicas')
    op.drop_index('ix_leases_expires_at', table_name='leases')
    op.drop_index('ix_grants_tier_id', table_name='grants')
    op.drop_table('grants')
