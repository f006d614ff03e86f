"""The composition root: a directory replica's parts, each built once from its settings and handed
only the parts it uses. The process (`app.py`) and the tests' stacks build a replica this way.

    parts = build(settings)   # migrations run first if the settings say so
    parts.close()             # once HTTP and the background thread have stopped
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.directory.admin import Admin
from kvstore.directory.db import engine as db
from kvstore.directory.db.changelog import ChangeLog
from kvstore.directory.db.index import Index
from kvstore.directory.db.writer import Writer
from kvstore.directory.handoffs import Handoffs
from kvstore.directory.http.auth import Tokens
from kvstore.directory.replica.leader import Leader
from kvstore.directory.loads.loads import Loads
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.moves.move import Moves
from kvstore.directory.moves.order import ChildOrder
from kvstore.directory.moves.orphans import Orphans
from kvstore.directory.moves.spread import Spread
from kvstore.directory.moves.tiers import Movement
from kvstore.directory.namespaces import Namespaces
from kvstore.directory.replica.reaper import Reaper
from kvstore.directory.saves.reservations import Reservations
from kvstore.directory.saves.store import Store
from kvstore.directory.replica.service import DirectoryService
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.tier_policies import TierPolicies
from kvstore.directory.workers.calls import WorkerCalls
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.membership import Membership
from kvstore.directory.workers.reclaim import Reclaim

if TYPE_CHECKING:
    from kvstore.directory.db.engine import Engine, Session, sessionmaker


@dataclass(frozen=True)
class Parts:
    """What the routes, the background thread and the election are handed."""

    settings: DirectorySettings
    engine: Engine
    service: DirectoryService  # the hot calls, checked; the election's view of the replica
    namespaces: Namespaces
    admin: Admin
    tokens: Tokens
    leader: Leader

    def close(self) -> None:
        self.service.close()
        self.engine.dispose()


def build(settings: DirectorySettings | None = None, clock: Callable[[], float] = time.time) -> Parts:
    settings = settings or DirectorySettings()
    if settings.migrate_on_start:
        db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)
    sessions: sessionmaker[Session] = db.make_sessions(engine)
    changelog = ChangeLog(enabled=engine.dialect.name == "postgresql")  # SQLite: one directory, leading at once
    role = changelog.role
    changelog.relaxed = changelog.enabled and settings.relaxed_commits
    metrics = DirectoryMetrics()

    policies = (ChildOrder(settings.tier_eviction(), settings.tier_admission(), settings.database_url)
                if settings.eviction_order == "child" else TierPolicies(settings.tier_eviction(), settings.tier_admission()))
    index = Index(on_change=policies.changed)
    pools = PagePools()
    writer = Writer(sessions, lambda *commit: index.follow_commit(sessions, *commit), changelog.before_commit,
                    relax=changelog.relaxed)
    write = writer.run
    calls = WorkerCalls(move_timeout_s=settings.move_timeout_s, ca_file=settings.ca_file)
    reclaim = Reclaim(calls, pools)
    reservations = Reservations()
    moves = Moves(write, calls, reclaim, pools, metrics, index, clock)
    movement = Movement(write, moves, reclaim, pools, policies, reservations.reserved_bytes,
                        promote_timeout_s=min(settings.move_timeout_s, settings.lease_ttl_s), read=writer.read)
    membership = Membership(write, calls, reclaim, pools, settings, clock, index.ids)
    store = Store(writer, index, pools, reservations, policies, metrics, settings, movement.make_room, clock)
    loads = Loads(write, index, movement.promote, reclaim, policies, metrics, settings, clock, calls.verify,
                  calls.secret)
    handoffs = Handoffs(write, sessions, index.count, metrics, lambda: role.leading, clock)
    reaper = Reaper(writer, reclaim, membership, handoffs, store, loads, Orphans(write, moves, calls, reclaim),
                    Spread(write, moves, reclaim, pools), movement, metrics, clock)
    namespaces = Namespaces(write, sessions, clock)
    service = DirectoryService(
        settings=settings, sessions=sessions, changelog=changelog, metrics=metrics, writer=writer, index=index,
        policies=policies, pools=pools, calls=calls, reclaim=reclaim, reservations=reservations, store=store,
        loads=loads, handoffs=handoffs, membership=membership, movement=movement, reaper=reaper,
        namespaces=namespaces, clock=clock)
    admin = Admin(sessions, writer, index, role, movement, reclaim, reservations, pools, membership, metrics)
    tokens = Tokens(sessions, write)
    tokens.load()
    leader = Leader(service, changelog, engine, settings.advertise_url)
    return Parts(settings, engine, service, namespaces, admin, tokens, leader)
