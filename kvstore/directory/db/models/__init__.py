"""One table per module. Schema changes only through alembic migrations in kvstore/directory/db/migrations/."""

from kvstore.directory.db.models.base import Base
from kvstore.directory.db.models.block import Block
from kvstore.directory.db.models.change import Change
from kvstore.directory.db.models.commit_mark import CommitMark
from kvstore.directory.db.models.grant import Grant
from kvstore.directory.db.models.handoff import HandoffRow
from kvstore.directory.db.models.leader import LeaderRow
from kvstore.directory.db.models.lease import Lease
from kvstore.directory.db.models.namespace import NamespaceRow
from kvstore.directory.db.models.replica import Replica
from kvstore.directory.db.models.tier import Tier
from kvstore.directory.db.models.token import TokenRow
from kvstore.directory.db.models.worker import Worker

__all__ = ["Base", "Block", "Change", "CommitMark", "Grant", "HandoffRow", "LeaderRow", "Lease", "NamespaceRow", "Replica", "Tier",
           "TokenRow", "Worker"]
