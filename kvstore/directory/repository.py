"""SQL only: reads and writes of the directory's tables, no rules."""

from __future__ import annotations

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.orm import Session, aliased

from kvstore.directory.models import Block, Lease, NamespaceRow, Replica, Tier, Worker
from kvstore.directory.models.replica import MOVING, READY, VISIBLE, WRITING

VOLATILE_TIERS = ("hbm", "dram")


def namespace(session: Session, namespace_id: str) -> NamespaceRow | None:
    return session.get(NamespaceRow, namespace_id)


def worker_by_name(session: Session, name: str) -> Worker | None:
    return session.scalar(select(Worker).where(Worker.name == name))


def workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.name)))


def tiers_of(session: Session, worker_id: int) -> dict[str, Tier]:
    return {t.kind: t for t in session.scalars(select(Tier).where(Tier.worker_id == worker_id))}


def active_tiers(session: Session, kind: str) -> list[tuple[Tier, Worker]]:
    query = (select(Tier, Worker).join(Worker, Tier.worker_id == Worker.id)
             .where(Tier.kind == kind, Worker.state == "active"))
    return [(t, w) for t, w in session.execute(query)]


def blocks_by_hash(session: Session, namespace_id: str, hashes: list[str]) -> dict[str, Block]:
    found: dict[str, Block] = {}
    for start in range(0, len(hashes), 500):  # keep IN lists within database limits
        chunk = hashes[start : start + 500]
        query = select(Block).where(Block.namespace_id == namespace_id, Block.hash.in_(chunk))
        found.update((b.hash, b) for b in session.scalars(query))
    return found


def replicas_of(session: Session, block_ids: list[int]) -> list[tuple[Replica, Tier, Worker]]:
    rows = []
    for start in range(0, len(block_ids), 500):
        chunk = block_ids[start : start + 500]
        query = (select(Replica, Tier, Worker).join(Tier, Replica.tier_id == Tier.id)
                 .join(Worker, Tier.worker_id == Worker.id).where(Replica.block_id.in_(chunk)))
        rows.extend(session.execute(query).tuples())
    return rows


def is_visible(replica: Replica, tier: Tier, worker: Worker) -> bool:
    """Readable now: READY/MOVING on a live worker; a memory tier only in the epoch that wrote it."""
    if replica.state not in VISIBLE or (tier.kind != "s3" and worker.state == "dead"):
        return False
    return tier.kind not in VOLATILE_TIERS or replica.epoch == worker.epoch


def visible_replicas(session: Session, block_ids: list[int]) -> list[tuple[Replica, Tier, Worker]]:
    return [(r, t, w) for r, t, w in replicas_of(session, block_ids) if is_visible(r, t, w)]


def insert_blocks(session: Session, rows: list[dict]) -> dict[str, int]:
    """Insert block rows in one statement; returns hash -> id."""
    if not rows:
        return {}
    return {h: i for i, h in session.execute(insert(Block).returning(Block.id, Block.hash), rows)}


def insert_replicas(session: Session, rows: list[dict]) -> None:
    if rows:
        session.execute(insert(Replica), rows)


def replicas_with_token(session: Session, token: str, state: str) -> list[tuple[Replica, Block, Tier, Worker]]:
    query = (select(Replica, Block, Tier, Worker).join(Block, Replica.block_id == Block.id)
             .join(Tier, Replica.tier_id == Tier.id).join(Worker, Tier.worker_id == Worker.id)
             .where(Replica.token == token, Replica.state == state))
    return list(session.execute(query).tuples())


def writing_rows(session: Session, token: str):
    """(replica_id, replica_epoch, expires_at, block_id, hash, worker_epoch) of a reservation, as plain rows."""
    query = (select(Replica.id, Replica.epoch, Replica.expires_at, Block.id, Block.hash, Worker.epoch)
             .join(Block, Replica.block_id == Block.id).join(Tier, Replica.tier_id == Tier.id)
             .join(Worker, Tier.worker_id == Worker.id).where(Replica.token == token, Replica.state == WRITING))
    return list(session.execute(query))


def replica_rows(session: Session, replica_ids: list[int]) -> list[tuple[Replica, Tier, Worker]]:
    if not replica_ids:
        return []
    query = (select(Replica, Tier, Worker).join(Tier, Replica.tier_id == Tier.id)
             .join(Worker, Tier.worker_id == Worker.id).where(Replica.id.in_(replica_ids)))
    return list(session.execute(query).tuples())


def expired_reservations(session: Session, now: float) -> list[str]:
    query = select(Replica.token).where(Replica.state == WRITING, Replica.expires_at < now).distinct()
    return list(session.scalars(query))


def touch_blocks(session: Session, block_ids: list[int], now: float) -> None:
    if block_ids:
        session.execute(update(Block).where(Block.id.in_(block_ids))
                        .values(last_access=now, hit_count=Block.hit_count + 1))


def delete_orphan_blocks(session: Session, block_ids: list[int]) -> None:
    """Blocks whose last replica is gone leave the map."""
    if block_ids:
        has_replica = select(Replica.id).where(Replica.block_id == Block.id).exists()
        session.execute(delete(Block).where(Block.id.in_(block_ids), ~has_replica))


def add_leases(session: Session, replica_ids: list[int], token: str, holder: str, expires_at: float) -> None:
    if replica_ids:
        session.execute(insert(Lease), [dict(replica_id=r, token=token, holder=holder, expires_at=expires_at)
                                        for r in replica_ids])


def commit_replicas(session: Session, replica_ids: list[int], checksums: dict[int, str]) -> None:
    """WRITING -> READY for `replica_ids`; record each block's checksum (block id -> checksum)."""
    if replica_ids:
        session.execute(update(Replica).where(Replica.id.in_(replica_ids)).values(state=READY, expires_at=None)
                        .execution_options(synchronize_session=False))
        table = Block.__table__
        session.connection().execute(
            update(table).where(table.c.id == bindparam("b_id")).values(checksum=bindparam("b_sum")),
            [{"b_id": b, "b_sum": c} for b, c in checksums.items()])


def pinned_by_token(session: Session, token: str) -> list[tuple[Replica, Block]]:
    query = (select(Replica, Block).join(Lease, Lease.replica_id == Replica.id)
             .join(Block, Replica.block_id == Block.id).where(Lease.token == token))
    return list(session.execute(query).tuples())


def leases_with_token(session: Session, token: str) -> list[Lease]:
    return list(session.scalars(select(Lease).where(Lease.token == token)))


def delete_leases(session: Session, token: str) -> None:
    session.execute(delete(Lease).where(Lease.token == token))


def delete_expired_leases(session: Session, now: float) -> int:
    return session.execute(delete(Lease).where(Lease.expires_at < now)).rowcount or 0


def pinned_replica_ids(session: Session, replica_ids: list[int]) -> set[int]:
    if not replica_ids:
        return set()
    return set(session.scalars(select(Lease.replica_id).where(Lease.replica_id.in_(replica_ids))))


def replicas_in_state(session: Session, state: str) -> list[tuple[Replica, Tier, Worker]]:
    query = (select(Replica, Tier, Worker).join(Tier, Replica.tier_id == Tier.id)
             .join(Worker, Tier.worker_id == Worker.id).where(Replica.state == state))
    return list(session.execute(query).tuples())


def drop_replicas(session: Session, replica_ids: list[int]) -> None:
    if replica_ids:
        session.execute(delete(Lease).where(Lease.replica_id.in_(replica_ids)))
        session.execute(delete(Replica).where(Replica.id.in_(replica_ids)))


def volatile_replicas_of_worker(session: Session, worker_id: int) -> list[tuple[Replica, Tier]]:
    query = (select(Replica, Tier).join(Tier, Replica.tier_id == Tier.id)
             .where(Tier.worker_id == worker_id, Tier.kind.in_(VOLATILE_TIERS)))
    return list(session.execute(query).tuples())


def tier_usage(session: Session) -> list[tuple[Tier, Worker, int]]:
    counts = (select(Replica.tier_id, func.count(Replica.id).label("n"))
              .where(Replica.state.in_(VISIBLE)).group_by(Replica.tier_id).subquery())
    query = (select(Tier, Worker, func.coalesce(counts.c.n, 0))
             .join(Worker, Tier.worker_id == Worker.id)
             .outerjoin(counts, counts.c.tier_id == Tier.id).order_by(Worker.name, Tier.kind))
    return [(t, w, int(n)) for t, w, n in session.execute(query)]


def counts(session: Session) -> dict[str, int]:
    return {
        "blocks": session.scalar(select(func.count(Block.id))) or 0,
        "replicas": session.scalar(select(func.count(Replica.id))) or 0,
        "reservations": session.scalar(select(func.count(Replica.id)).where(Replica.state == WRITING)) or 0,
        "leases_active": session.scalar(select(func.count(func.distinct(Lease.token)))) or 0,
        "pins": session.scalar(select(func.count(Lease.id))) or 0,
        "workers_active": session.scalar(select(func.count(Worker.id)).where(Worker.state == "active")) or 0,
        "inflight_moves": session.scalar(select(func.count(Replica.id)).where(Replica.state == MOVING)) or 0,
    }


def replicas_by_tier(session: Session) -> dict[str, int]:
    """Visible replicas per tier kind, over all workers."""
    query = (select(Tier.kind, func.count(Replica.id)).join(Tier, Replica.tier_id == Tier.id)
             .where(Replica.state.in_(VISIBLE)).group_by(Tier.kind))
    return {kind: n for kind, n in session.execute(query)}


def visible_replica_rows(session: Session, namespace_id: str | None) -> list[Replica]:
    query = select(Replica).join(Block, Replica.block_id == Block.id).where(Replica.state.in_(VISIBLE))
    if namespace_id is not None:
        query = query.where(Block.namespace_id == namespace_id)
    return list(session.scalars(query))


def durable_replicas_of_worker(session: Session, worker_id: int) -> list[tuple[Replica, Tier, Block]]:
    query = (select(Replica, Tier, Block).join(Tier, Replica.tier_id == Tier.id)
             .join(Block, Replica.block_id == Block.id)
             .where(Tier.worker_id == worker_id, Tier.kind.not_in(VOLATILE_TIERS)))
    return list(session.execute(query).tuples())


def recompute_used(session: Session, tier: Tier) -> None:
    tier.used_bytes = session.scalar(select(func.coalesce(func.sum(Replica.reserved_bytes), 0))
                                     .where(Replica.tier_id == tier.id)) or 0


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


def replicas_by_id(session: Session, replica_ids: list[int]) -> dict[int, Replica]:
    found: dict[int, Replica] = {}
    for start in range(0, len(replica_ids), 500):
        chunk = replica_ids[start : start + 500]
        found.update((r.id, r) for r in session.scalars(select(Replica).where(Replica.id.in_(chunk))))
    return found


def write_through_candidates(session: Session, limit: int) -> list[tuple[Replica, Block, Tier, Worker]]:
    """READY DRAM/NVMe replicas of write-through namespaces whose block has no S3 copy yet, on workers
    that have an S3 tier."""
    s3_tier = aliased(Tier)
    has_s3_tier = select(s3_tier.id).where(s3_tier.worker_id == Worker.id, s3_tier.kind == "s3").exists()
    other, other_tier = aliased(Replica), aliased(Tier)
    has_s3_copy = (select(other.id).join(other_tier, other.tier_id == other_tier.id)
                   .where(other.block_id == Block.id, other_tier.kind == "s3").exists())
    query = (select(Replica, Block, Tier, Worker).join(Block, Replica.block_id == Block.id)
             .join(NamespaceRow, Block.namespace_id == NamespaceRow.id)
             .join(Tier, Replica.tier_id == Tier.id).join(Worker, Tier.worker_id == Worker.id)
             .where(NamespaceRow.write_through, Replica.state == READY, Tier.kind.in_(("dram", "nvme")),
                    Worker.state == "active", has_s3_tier, ~has_s3_copy)
             .order_by(Block.created_at).limit(limit))
    return list(session.execute(query).tuples())


def replica_block_pairs(session: Session, replica_ids: list[int]) -> list[tuple[Replica, Block]]:
    """(replica, its block) for these ids, in the order given; missing ids are left out."""
    found: dict[int, tuple[Replica, Block]] = {}
    for start in range(0, len(replica_ids), 500):
        chunk = replica_ids[start : start + 500]
        query = select(Replica, Block).join(Block, Replica.block_id == Block.id).where(Replica.id.in_(chunk))
        found.update((r.id, (r, b)) for r, b in session.execute(query).tuples())
    return [found[i] for i in replica_ids if i in found]
