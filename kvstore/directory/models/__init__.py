"""One table per module. Schema changes only through alembic migrations in kvstore/directory/migrations/."""

from kvstore.directory.models.base import Base
from kvstore.directory.models.block import Block
from kvstore.directory.models.change import Change
from kvstore.directory.models.grant import Grant
from kvstore.directory.models.handoff import HandoffRow
from kvstore.directory.models.leader import LeaderRow
from kvstore.directory.models.lease import Lease
from kvstore.directory.models.namespace import NamespaceRow
from kvstore.directory.models.replica import Replica
from kvstore.directory.models.tier import Tier
from kvstore.directory.models.token import TokenRow
from kvstore.directory.models.worker import Worker

__all__ = ["Base", "Block", "Change", "Grant", "HandoffRow", "LeaderRow", "Lease", "NamespaceRow", "Replica", "Tier",
           "TokenRow", "Worker"]
