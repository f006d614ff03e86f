"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 07:43:00.113763
"""
from alembic import op
import sqlalchemy as sa

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

def upgrade() -> None:
    op.create_table('namespaces',
    sa.Column('id', sa.String(length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('workers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('agent_name', sa.String(length=200), nullable=False),
    sa.Column('agent_metadata', sa.LargeBinary(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('control_url', sa.String(length=500), nullable=False),
    sa.Column('backends', sa.JSON(), nullable=False),
    sa.Column('heartbeat_at', sa.Float(), nullable=False),
    sa.Column('registered_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('blocks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('namespace_id', sa.String(length=16), nullable=False),
    sa.Column('hash', sa.String(length=128), nullable=False),
    sa.Column('parent', sa.String(length=128), nullable=True),
    sa.Column('depth', sa.Integer(), nullable=False),
    sa.Column('nbytes', sa.BigInteger(), nullable=False),
    sa.Column('checksum', sa.String(length=16), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('last_access', sa.Float(), nullable=False),
    sa.Column('hit_count', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['namespace_id'], ['namespaces.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('namespace_id', 'hash')
    )
    op.create_table('tiers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('worker_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('capacity_bytes', sa.BigInteger(), nullable=True),
    sa.Column('used_bytes', sa.BigInteger(), nullable=False),
    sa.Column('page_bytes', sa.BigInteger(), nullable=False),
    sa.Column('base_addr', sa.BigInteger(), nullable=False),
    sa.Column('high_watermark', sa.Float(), nullable=False),
    sa.Column('low_watermark', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['worker_id'], ['workers.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('worker_id', 'kind')
    )
    op.create_table('replicas',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('block_id', sa.Integer(), nullable=False),
    sa.Column('tier_id', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('token', sa.String(length=64), nullable=False),
    sa.Column('pages', sa.JSON(), nullable=False),
    sa.Column('reserved_bytes', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['block_id'], ['blocks.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tier_id'], ['tiers.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_replicas_block_id'), ['block_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_replicas_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_replicas_tier_id'), ['tier_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_replicas_token'), ['token'], unique=False)

    op.create_table('leases',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('replica_id', sa.Integer(), nullable=False),
    sa.Column('token', sa.String(length=64), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['replica_id'], ['replicas.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_leases_replica_id'), ['replica_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_token'), ['token'], unique=False)

    # ### end Alembic commands ###

def downgrade() -> None:
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_leases_token'))
        batch_op.drop_index(batch_op.f('ix_leases_replica_id'))

    op.drop_table('leases')
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_replicas_token'))
        batch_op.drop_index(batch_op.f('ix_replicas_tier_id'))
        batch_op.drop_index(batch_op.f('ix_replicas_state'))
        batch_op.drop_index(batch_op.f('ix_replicas_block_id'))

    op.drop_table('replicas')
    op.drop_table('tiers')
    op.drop_table('blocks')
    op.drop_table('workers')
    op.drop_table('namespaces')
