"""SQL only, for moving blocks between tiers and workers: victims, copies, write-through, replication.

A copy's own statements (its sources, their states) go straight through the driver, as saves do:
a move handles a row per block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from sqlalchemy import case, distinct, func, select
from sqlalchemy.orm import Session, aliased

from kvstore.directory.db.direct import chunks, json_value, marks, rows, runs_value, shrink, stream
from kvstore.directory.db.models import Block, Lease, NamespaceRow, Replica, Tier, Worker
from kvstore.directory.db.models.replica import MOVING, READY, VISIBLE, WRITING
from kvstore.core.pace import paced


class VictimReplica(NamedTuple):
    id: int
    reserved_bytes: int


class VictimBlock(NamedTuple):
    id: int
    namespace_id: str
    hash: str
    parent: str | None
    nbytes: int
    last_access: float
    depth: int
    hit_count: int


_VICTIM_COLUMNS = ("r.id, r.reserved_bytes, b.id, b.namespace_id, b.hash, b.parent, b.nbytes, b.last_access, b.depth, "
                   "b.hit_count")
_VICTIMS = (f"SELECT {_VICTIM_COLUMNS}{{}} FROM replicas r JOIN blocks b ON b.id = r.block_id "
            f"WHERE r.tier_id = ? AND r.state = '{READY}'")
# Blocks named by id: tier and state compared in Python (`direct.py`: statements that name rows)
_BY_ID = (f"SELECT {_VICTIM_COLUMNS}, r.tier_id, r.state FROM replicas r JOIN blocks b ON b.id = r.block_id "
          "WHERE r.block_id IN ({})")
_PINNED = "EXISTS (SELECT 1 FROM leases l WHERE l.replica_id = r.id)"


def _victim(row) -> tuple[VictimReplica, VictimBlock]:
    return VictimReplica(*row[:2]), VictimBlock(*row[2:10])


def demotion_candidates(session: Session, tier_id: int, limit: int,
                        namespace_id: str | None = None) -> list[tuple[VictimReplica, VictimBlock]]:
    """READY, unpinned replicas of a tier, least recently used first (deeper blocks first on ties)."""
    where, params = (" AND b.namespace_id = ?", (namespace_id,)) if namespace_id is not None else ("", ())
    return [_victim(row) for row in rows(
        session, _VICTIMS.format("") + f" AND NOT {_PINNED}{where} ORDER BY b.last_access, b.depth DESC LIMIT ?",
        (tier_id, *params, limit))]


ParentId = Callable[[str, str | None], int | None]  # (namespace, parent hash) -> the parent's block id


def _no_parent(namespace_id: str, parent: str | None) -> None:
    return None


def ready_replicas_of_tier(session: Session, tier_id: int, parent_id: ParentId = _no_parent,
                           ) -> list[tuple[VictimReplica, VictimBlock, bool, int | None]]:
    """Every READY replica of a tier with its block, whether a reader pins it, and its parent
    block's id (None: no parent, or not stored). `parent_id`: the lookup index's (`Index.id_of`): no
    SQL index joins a block to its parent by hash (`models/block.py`), and without one each row
    scanned the table."""
    return [(*_victim(row), bool(row[10]), parent_id(row[3], row[5])) for row in rows(
        session, f"SELECT {_VICTIM_COLUMNS}, {_PINNED} FROM replicas r JOIN blocks b ON b.id = r.block_id "
        f"WHERE r.tier_id = ? AND r.state = '{READY}'", (tier_id,))]


def policy_rows(session: Session, tier_id: int, fill: Callable[[list[tuple]], None],
                parent_id: ParentId = _no_parent, at_once: int = 10_000) -> None:
    """(block id, parent block id, hit count, namespace id, hash) of every READY replica of a tier,
    the namespace and hash only where the hit count is not 0, oldest first (deeper blocks first
    on ties), handed to `fill` `at_once` at a time as a policy is built from them: sorted by the
    database, which holds no GIL, into plain tuples of plain values. The parent's id comes from
    `parent_id` (as in `ready_replicas_of_tier`)."""
    for chunk in stream(session, "SELECT b.id, b.namespace_id, b.parent, b.hit_count, CASE WHEN b.hit_count > 0 "
                        "THEN b.hash END FROM replicas r JOIN blocks b ON b.id = r.block_id "
                        f"WHERE r.tier_id = ? AND r.state = '{READY}' ORDER BY b.last_access, b.depth DESC",
                        (tier_id,), at_once):
        fill([(block_id, parent_id(namespace_id, parent), hits, namespace_id if hits else None, block_hash)
              for block_id, namespace_id, parent, hits, block_hash in paced(chunk)])
    shrink(session)


def order_rows(session: Session, tier_id: int, at_once: int = 10_000):
    """(block id, namespace id, hash, parent hash, hit count) of every READY replica of a tier, oldest
    first (deeper blocks first on ties), `at_once` rows at a time: the eviction order's own process
    builds a tier's order from them and finds parents among them (`moves/order_child.py`)."""
    yield from stream(session, "SELECT b.id, b.namespace_id, b.hash, b.parent, b.hit_count FROM replicas r "
                      f"JOIN blocks b ON b.id = r.block_id WHERE r.tier_id = ? AND r.state = '{READY}' "
                      "ORDER BY b.last_access, b.depth DESC", (tier_id,), at_once)
    shrink(session)


def replica_kinds(session: Session, block_ids: list[int]) -> dict[int, set[str]]:
    """Per block, the tier kinds holding a READY or MOVING replica."""
    kinds: dict[int, set[str]] = {}
    for chunk in chunks(block_ids):
        for block_id, kind, state in rows(
                session, "SELECT r.block_id, t.kind, r.state FROM replicas r JOIN tiers t ON t.id = r.tier_id "
                f"WHERE r.block_id IN ({marks(len(chunk))})", tuple(chunk)):
            if state in VISIBLE:  # compared here, not in SQL (`direct.py`: statements that name rows)
                kinds.setdefault(block_id, set()).add(kind)
    return kinds


def move_destinations(session: Session) -> list[tuple[str, int]]:
    """(token, the destination's worker id) of every WRITING replica a move reserved."""
    query = (select(Replica.token, Tier.worker_id).join(Tier, Replica.tier_id == Tier.id)
             .where(Replica.state == WRITING, Replica.token.like("move-%")).distinct())
    return [(token, worker_id) for token, worker_id in session.execute(query)]


class MoveSource(NamedTuple):
    """A replica a copy reads from, with what the copy needs of its block."""
    state: str
    pages: list
    created_at: float
    block_id: int
    nbytes: int
    checksum: str | None
    namespace_id: str
    hash: str


def move_sources(session: Session, replica_ids: list[int]) -> dict[int, MoveSource]:
    """replica id -> the replica and its block; missing ids are left out."""
    found: dict[int, MoveSource] = {}
    for chunk in chunks(replica_ids):
        for replica_id, state, pages, *rest in rows(
                session, "SELECT r.id, r.state, r.pages, r.created_at, b.id, b.nbytes, b.checksum, b.namespace_id, "
                f"b.hash FROM replicas r JOIN blocks b ON b.id = r.block_id WHERE r.id IN ({marks(len(chunk))})",
                tuple(chunk)):
            found[replica_id] = MoveSource(state, json_value(pages), *rest)
    return found


def states_of(session: Session, replica_ids: list[int]) -> dict[int, tuple[str, int, str]]:
    """replica id -> (state, reserved bytes, token); missing ids are left out."""
    found: dict[int, tuple[str, int, str]] = {}
    for chunk in chunks(replica_ids):
        found.update((i, (state, n, token)) for i, state, n, token in rows(
            session, f"SELECT id, state, reserved_bytes, token FROM replicas WHERE id IN ({marks(len(chunk))})",
            tuple(chunk)))
    return found


def pages_of_tokens(session: Session, tokens: set[str]) -> set[tuple[str, tuple]]:
    """(token, ((first, count), ...)) of every replica held under these tokens (no index serves tokens:
    asked only when a move's destination was dropped while the move ran, which is rare)."""
    found = set()
    for chunk in chunks(sorted(tokens)):
        for token, pages in rows(session, f"SELECT token, pages FROM replicas WHERE token IN ({marks(len(chunk))})",
                                 tuple(chunk)):
            found.add((token, tuple(tuple(run) for run in runs_value(pages))))
    return found


def write_through_namespaces(session: Session) -> list[str]:
    return list(session.scalars(select(NamespaceRow.id).where(NamespaceRow.write_through)))


def write_through_candidates(session: Session, namespace_ids: list[str],
                             limit: int) -> list[tuple[Replica, Block, Tier, Worker]]:
    """READY DRAM/NVMe replicas of these (write-through) namespaces whose block has no S3 copy yet, on
    workers that have an S3 tier."""
    s3_tier = aliased(Tier)
    has_s3_tier = select(s3_tier.id).where(s3_tier.worker_id == Worker.id, s3_tier.kind == "s3").exists()
    other, other_tier = aliased(Replica), aliased(Tier)
    has_s3_copy = (select(other.id).join(other_tier, other.tier_id == other_tier.id)
                   .where(other.block_id == Block.id, other_tier.kind == "s3").exists())
    query = (select(Replica, Block, Tier, Worker).join(Block, Replica.block_id == Block.id)
             .join(Tier, Replica.tier_id == Tier.id).join(Worker, Tier.worker_id == Worker.id)
             .where(Block.namespace_id.in_(namespace_ids), Replica.state == READY,
                    Tier.kind.in_(("dram", "nvme")), Worker.state == "active", has_s3_tier, ~has_s3_copy)  # the
                    # tiers a write-through copy is made from: DRAM, or NVMe when the block went down first
             .order_by(Block.created_at).limit(limit))
    return list(session.execute(query).tuples())


def tier_fill(session: Session, tier_id: int) -> tuple[int | None, int, float] | None:
    """(capacity bytes, used bytes, low watermark) of a tier, None if it is gone."""
    found = rows(session, "SELECT capacity_bytes, used_bytes, low_watermark FROM tiers WHERE id = ?", (tier_id,))
    return tuple(found[0]) if found else None


def pinned_blocks(session: Session, tier_id: int) -> set[int]:
    """Ids of the blocks whose replica on this tier a reader pins."""
    query = select(Replica.block_id, Replica.tier_id).select_from(Lease).join(Replica, Lease.replica_id == Replica.id)
    return {block_id for block_id, tier in session.execute(query) if tier == tier_id}  # from the leases, which are
    # few: a WHERE on the tier would walk every replica of it (`direct.py`: statements that name rows)


def ready_replicas_of_blocks(session: Session, tier_id: int,
                             block_ids: list[int]) -> list[tuple[VictimReplica, VictimBlock]]:
    """READY replicas on this tier of these blocks, in the order of `block_ids`."""
    found: dict[int, tuple[VictimReplica, VictimBlock]] = {}
    for chunk in chunks(block_ids):
        read = rows(session, _BY_ID.format(marks(len(chunk))), tuple(chunk))
        found.update((row[2], _victim(row)) for row in paced(read) if row[10] == tier_id and row[11] == READY)
    return [found[i] for i in block_ids if i in found]


def replicated_namespaces(session: Session) -> dict[str, int]:
    """Namespaces that want each block on more than one worker, and how many."""
    query = select(NamespaceRow.id, NamespaceRow.replicas).where(NamespaceRow.replicas > 1)
    return {namespace_id: n for namespace_id, n in session.execute(query)}


def under_replicated(session: Session, namespace_id: str, wanted: int, limit: int) -> list[int]:
    """Blocks of a namespace that a live worker holds (READY or MOVING, in HBM, DRAM or NVMe) but fewer
    than `wanted` active workers do, oldest first."""
    active = func.count(distinct(case((Worker.state == "active", Tier.worker_id))))
    query = (select(Replica.block_id).join(Tier, Replica.tier_id == Tier.id).join(Worker, Tier.worker_id == Worker.id)
             .join(Block, Replica.block_id == Block.id)
             .where(Block.namespace_id == namespace_id, Replica.state.in_(VISIBLE),
                    Tier.kind.in_(("hbm", "dram", "nvme")), Worker.state != "dead")
             .group_by(Replica.block_id).having(active < wanted).order_by(Replica.block_id).limit(limit))
    return list(session.scalars(query))


def stranded_moving(session: Session) -> list[Replica]:
    """MOVING replicas that no move copies any more: their block has no WRITING move destination
    (a move whose last step failed; its destination was rolled back when it expired)."""
    dest = aliased(Replica)
    copying = select(dest.id).where(dest.block_id == Replica.block_id, dest.state == WRITING,
                                    dest.token.like("move-%")).exists()
    return list(session.scalars(select(Replica).where(Replica.state == MOVING, ~copying)))
