"""SQL only, for moving blocks between tiers and workers: victims, copies, write-through, replication."""

from __future__ import annotations

from sqlalchemy import case, distinct, func, select
from sqlalchemy.orm import Session, aliased

from kvstore.directory.db.models import Block, Lease, NamespaceRow, Replica, Tier, Worker
from kvstore.directory.db.models.replica import MOVING, READY, VISIBLE, WRITING
from kvstore.directory.db.repository import chunks, replicas_of


def demotion_candidates(session: Session, tier_id: int, limit: int,
                        namespace_id: str | None = None) -> list[tuple[Replica, Block]]:
    """READY, unpinned replicas of a tier, least recently used first (deeper blocks first on ties)."""
    pinned = select(Lease.id).where(Lease.replica_id == Replica.id).exists()
    query = (select(Replica, Block).join(Block, Replica.block_id == Block.id)
             .where(Replica.tier_id == tier_id, Replica.state == READY, ~pinned)
             .order_by(Block.last_access, Block.depth.desc()).limit(limit))
    if namespace_id is not None:
        query = query.where(Block.namespace_id == namespace_id)
    return list(session.execute(query).tuples())


def ready_replicas_of_tier(session: Session, tier_id: int) -> list[tuple[Replica, Block, bool]]:
    """Every READY replica of a tier with its block, and whether a reader pins it."""
    pinned = select(Lease.id).where(Lease.replica_id == Replica.id).exists()
    query = (select(Replica, Block, pinned).join(Block, Replica.block_id == Block.id)
             .where(Replica.tier_id == tier_id, Replica.state == READY))
    return list(session.execute(query).tuples())


def replica_kinds(session: Session, block_ids: list[int]) -> dict[int, set[str]]:
    """Per block, the tier kinds holding a READY or MOVING replica."""
    kinds: dict[int, set[str]] = {}
    for replica, tier, worker in replicas_of(session, block_ids):
        if replica.state in VISIBLE:
            kinds.setdefault(replica.block_id, set()).add(tier.kind)
    return kinds


def move_destinations(session: Session) -> list[tuple[str, int]]:
    """(token, the destination's worker id) of every WRITING replica a move reserved."""
    query = (select(Replica.token, Tier.worker_id).join(Tier, Replica.tier_id == Tier.id)
             .where(Replica.state == WRITING, Replica.token.like("move-%")).distinct())
    return [(token, worker_id) for token, worker_id in session.execute(query)]


def replicas_by_id(session: Session, replica_ids: list[int]) -> dict[int, Replica]:
    found: dict[int, Replica] = {}
    for chunk in chunks(replica_ids):
        found.update((r.id, r) for r in session.scalars(select(Replica).where(Replica.id.in_(chunk))))
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


def replica_block_pairs(session: Session, replica_ids: list[int]) -> list[tuple[Replica, Block]]:
    """(replica, its block) for these ids, in the order given; missing ids are left out."""
    found: dict[int, tuple[Replica, Block]] = {}
    for chunk in chunks(replica_ids):
        query = select(Replica, Block).join(Block, Replica.block_id == Block.id).where(Replica.id.in_(chunk))
        found.update((r.id, (r, b)) for r, b in session.execute(query).tuples())
    return [found[i] for i in replica_ids if i in found]


def pinned_keys(session: Session, tier_id: int) -> set[str]:
    """`namespace/hash` of the blocks whose replica on this tier a reader pins."""
    query = (select(Block.namespace_id, Block.hash).join(Replica, Replica.block_id == Block.id)
             .join(Lease, Lease.replica_id == Replica.id).where(Replica.tier_id == tier_id))
    return {f"{n}/{h}" for n, h in session.execute(query)}


def keys_of(session: Session, block_ids) -> set[str]:
    keys: set[str] = set()
    for chunk in chunks(list(block_ids)):
        keys.update(f"{n}/{h}" for n, h in session.execute(
            select(Block.namespace_id, Block.hash).where(Block.id.in_(chunk))))
    return keys


def ready_replicas_by_key(session: Session, tier_id: int, keys: list[str]) -> list[tuple[Replica, Block]]:
    """READY replicas on this tier of the blocks named `namespace/hash`, in the order of `keys`."""
    by_namespace: dict[str, list[str]] = {}
    for key in keys:
        namespace_id, _, block_hash = key.partition("/")
        by_namespace.setdefault(namespace_id, []).append(block_hash)
    found: dict[str, tuple[Replica, Block]] = {}
    for namespace_id, hashes in by_namespace.items():
        for chunk in chunks(hashes):
            query = (select(Replica, Block).join(Block, Replica.block_id == Block.id)
                     .where(Replica.tier_id == tier_id, Replica.state == READY, Block.namespace_id == namespace_id,
                            Block.hash.in_(chunk)))
            found.update((f"{namespace_id}/{b.hash}", (r, b)) for r, b in session.execute(query).tuples())
    return [found[k] for k in keys if k in found]


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
