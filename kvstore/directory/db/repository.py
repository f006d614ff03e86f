"""SQL only: reads and writes of the directory's tables, no rules."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import delete, func, select, tuple_
from sqlalchemy.orm import Session

from kvstore.core.tiers import MEMORY
from kvstore.directory.db.models import Block, Grant, HandoffRow, Lease, NamespaceRow, Replica, Tier, Worker
from kvstore.directory.db import direct
from kvstore.directory.db.direct import chunks, driver_many
from kvstore.directory.db.models.replica import DELETING, MOVING, VISIBLE, WRITING


def touched(session: Session, block_ids) -> None:
    """Block rows a bulk statement changed, for the lookup index to reload after the commit (ORM
    flushes are noticed without this)."""
    session.info.setdefault("touched_blocks", set()).update(block_ids)


def namespace(session: Session, namespace_id: str) -> NamespaceRow | None:
    return session.get(NamespaceRow, namespace_id)


def worker(session: Session, worker_id: int) -> Worker | None:
    return session.get(Worker, worker_id)


def workers_at(session: Session, control_url: str) -> list[Worker]:
    return session.query(Worker).filter(Worker.control_url == control_url).all()


def tier(session: Session, tier_id: int) -> Tier | None:
    return session.get(Tier, tier_id)


def block(session: Session, block_id: int) -> Block | None:
    return session.get(Block, block_id)


def blocks_by_id(session: Session, block_ids: list[int]) -> dict[int, Block]:
    return {b.id: b for chunk in chunks(block_ids) for b in session.query(Block).filter(Block.id.in_(chunk))}


def namespace_rows(session: Session) -> list[NamespaceRow]:
    return session.query(NamespaceRow).order_by(NamespaceRow.created_at).all()


def add_namespace(session: Session, namespace_id: str, spec: dict, now: float) -> None:
    session.add(NamespaceRow(id=namespace_id, spec=spec, created_at=now))


def flush(session: Session) -> None:
    """Send what the session holds so far (new rows get their ids), inside the transaction."""
    session.flush()


def handoff_row(session: Session, key: tuple[str, str]) -> HandoffRow:
    """The hand-off's row (key: namespace id, hand-off id), a new one if there is none."""
    row = session.get(HandoffRow, key)
    if row is None:
        row = HandoffRow(namespace_id=key[0], handoff_id=key[1])
        session.add(row)
    return row


def new_worker(session: Session, name: str, now: float) -> Worker:
    worker = Worker(name=name, epoch=0, registered_at=now)
    session.add(worker)
    return worker


def tier_row(session: Session, existing: dict[str, Tier], worker_id: int, kind: str) -> Tier:
    """The worker's tier of this kind among `existing` (`tiers_of`), a new one if it has none."""
    tier = existing.get(kind)
    if tier is None:
        tier = Tier(worker_id=worker_id, kind=kind, used_bytes=0)
        session.add(tier)
    return tier


def ping(session: Session) -> None:
    session.execute(select(1))


def pin_counts(session: Session, replica_ids: list[int]) -> dict[int, int]:
    """replica id -> the leases pinning it (only those pinned)."""
    pins: dict[int, int] = {}
    for chunk in chunks(replica_ids):
        query = select(Lease.replica_id, func.count(Lease.id)).where(Lease.replica_id.in_(chunk)) \
            .group_by(Lease.replica_id)
        pins.update((replica_id, int(n)) for replica_id, n in session.execute(query))
    return pins


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
    """A scan of the blocks (no index serves hashes: `models/block.py`), for admin calls and tests;
    the newest row of a hash wins. The lookup index answers the hot paths (`Index.ids`)."""
    found: dict[str, Block] = {}
    for chunk in chunks(hashes):
        query = select(Block).where(Block.namespace_id == namespace_id, Block.hash.in_(chunk)).order_by(Block.id)
        found.update((b.hash, b) for b in session.scalars(query))
    return found


def merge_blocks(session: Session, duplicates: dict[int, int]) -> None:
    """Duplicate rows a rebuild found (older id -> the newest row of its hash): their replicas move to
    the newest and they are deleted, so no replica (nor the pages it holds) is lost."""
    for chunk in chunks(sorted(duplicates)):
        driver_many(session, "UPDATE replicas SET block_id = ? WHERE block_id = ?",
                    [(_newest(duplicates, old), old) for old in chunk])
        direct.execute(session, f"DELETE FROM blocks WHERE id IN ({direct.marks(len(chunk))})", tuple(chunk))
    touched(session, set(duplicates) | set(duplicates.values()))


def _newest(duplicates: dict[int, int], block_id: int) -> int:
    while block_id in duplicates:  # three rows of a hash: the oldest names the middle one
        block_id = duplicates[block_id]
    return block_id


def replicas_of(session: Session, block_ids: list[int]) -> list[tuple[Replica, Tier, Worker]]:
    return _replicas_where(session, Replica.block_id, block_ids)


def _replicas_where(session: Session, column, ids: list[int]) -> list[tuple[Replica, Tier, Worker]]:
    """(replica, tier, worker) of the replicas whose `column` is in `ids`, chunked."""
    rows = []
    for chunk in chunks(ids):
        query = (select(Replica, Tier, Worker).join(Tier, Replica.tier_id == Tier.id)
                 .join(Worker, Tier.worker_id == Worker.id).where(column.in_(chunk)))
        rows.extend(session.execute(query).tuples())
    return rows


def replicas_with_token(session: Session, token: str, state: str) -> list[tuple[Replica, Block, Tier, Worker]]:
    query = (select(Replica, Block, Tier, Worker).join(Block, Replica.block_id == Block.id)
             .join(Tier, Replica.tier_id == Tier.id).join(Worker, Tier.worker_id == Worker.id)
             .where(Replica.token == token, Replica.state == state))
    return list(session.execute(query).tuples())


def replica_rows(session: Session, replica_ids: list[int]) -> list[tuple[Replica, Tier, Worker]]:
    return _replicas_where(session, Replica.id, replica_ids)


def expired_reservations(session: Session, now: float) -> list[str]:
    query = select(Replica.token).where(Replica.state == WRITING, Replica.expires_at < now).distinct()
    return list(session.scalars(query))


def record_hits(session: Session, hits: dict[int, tuple[float, int]]) -> None:
    """Access statistics gathered in memory: block id -> (last access, hits since the last flush)."""
    if hits:
        driver_many(session, f"UPDATE {Block.__tablename__} SET last_access = ?, hit_count = hit_count + ? "
                    "WHERE id = ?", [(at, n, b) for b, (at, n) in hits.items()])


def delete_orphan_blocks(session: Session, block_ids: list[int]) -> None:
    """Blocks whose last replica is gone leave the map."""
    for chunk in chunks(block_ids):
        direct.execute(session, f"DELETE FROM blocks WHERE id IN ({direct.marks(len(chunk))}) "
                       "AND NOT EXISTS (SELECT 1 FROM replicas r WHERE r.block_id = blocks.id)", tuple(chunk))


def pinned_by_token(session: Session, token: str) -> list[tuple[Replica, Block]]:
    query = (select(Replica, Block).join(Lease, Lease.replica_id == Replica.id)
             .join(Block, Replica.block_id == Block.id).where(Lease.token == token))
    return list(session.execute(query).tuples())


class Suspect(NamedTuple):
    """A pinned replica whose reader reported its bytes bad, with what its worker needs to check it."""
    hash: str
    kind: str
    pages: list
    nbytes: int
    checksum: str | None
    worker_url: str
    current: bool  # written in the worker's current epoch (else its memory is gone anyway)


def pinned_suspects(session: Session, token: str, hashes: list[str]) -> list[Suspect]:
    query = (select(Block.hash, Tier.kind, Replica.pages, Block.nbytes, Block.checksum, Worker.control_url,
                    Replica.epoch == Worker.epoch)
             .join(Lease, Lease.replica_id == Replica.id).join(Block, Replica.block_id == Block.id)
             .join(Tier, Replica.tier_id == Tier.id).join(Worker, Tier.worker_id == Worker.id))
    return [Suspect(*row) for chunk in chunks(hashes)
            for row in session.execute(query.where(Lease.token == token, Block.hash.in_(chunk)))]


def leases_with_token(session: Session, token: str) -> list[Lease]:
    return list(session.scalars(select(Lease).where(Lease.token == token)))


def delete_leases(session: Session, token: str) -> None:
    session.execute(delete(Lease).where(Lease.token == token))


def delete_expired_leases(session: Session, now: float) -> int:
    return session.execute(delete(Lease).where(Lease.expires_at < now)).rowcount or 0


def replicas_in_state(session: Session, state: str) -> list[tuple[Replica, Tier, Worker]]:
    query = (select(Replica, Tier, Worker).join(Tier, Replica.tier_id == Tier.id)
             .join(Worker, Tier.worker_id == Worker.id).where(Replica.state == state))
    return list(session.execute(query).tuples())


class ReplicaRef(NamedTuple):
    id: int
    block_id: int
    epoch: int
    token: str
    pages: list
    reserved_bytes: int


class TierRef(NamedTuple):
    id: int
    kind: str


class WorkerRef(NamedTuple):
    epoch: int
    state: str
    control_url: str


def unpinned_deleting(session: Session) -> list[tuple[ReplicaRef, TierRef, WorkerRef]]:
    """DELETING replicas no reader pins, with their tier and worker: plain rows, read through the
    driver (every move and every load's end asks)."""
    found = direct.rows(session, "SELECT r.id, r.block_id, r.epoch, r.token, r.pages, r.reserved_bytes, t.id, t.kind, "
                 "w.epoch, w.state, w.control_url FROM replicas r JOIN tiers t ON t.id = r.tier_id "
                 f"JOIN workers w ON w.id = t.worker_id WHERE r.state = '{DELETING}' "
                 "AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.replica_id = r.id)")
    return [(ReplicaRef(*row[:4], direct.json_value(row[4]), row[5]), TierRef(*row[6:8]), WorkerRef(*row[8:]))
            for row in found]


def drop_replicas(session: Session, replica_ids: list[int]) -> None:
    for chunk in chunks(replica_ids):
        ids = tuple(chunk)
        direct.execute(session, f"DELETE FROM leases WHERE replica_id IN ({direct.marks(len(ids))})", ids)
        touched(session, [b for b, in direct.rows(
            session, f"DELETE FROM replicas WHERE id IN ({direct.marks(len(ids))}) RETURNING block_id", ids)])


def add_used(session: Session, deltas: dict[int, int]) -> None:
    """tier id -> bytes: one atomic `used_bytes = used_bytes + delta` per tier (no read-modify-write).
    A tier this session holds as an ORM object is expired, so it reads the new count next."""
    driver_many(session, "UPDATE tiers SET used_bytes = used_bytes + ? WHERE id = ?",
                [(delta, tier_id) for tier_id, delta in deltas.items() if delta])
    direct.expire_loaded(session, Tier, [tier_id for tier_id, delta in deltas.items() if delta], ["used_bytes"])


def volatile_replicas_of_worker(session: Session, worker_id: int) -> list[tuple[Replica, Tier]]:
    query = (select(Replica, Tier).join(Tier, Replica.tier_id == Tier.id)
             .where(Tier.worker_id == worker_id, Tier.kind.in_(MEMORY)))
    return list(session.execute(query).tuples())


def tier_usage(session: Session) -> list[tuple[Tier, Worker, int, int, int]]:
    """Every tier with its worker, visible replicas, their KV bytes and the bytes of their pages."""
    counts = (select(Replica.tier_id, func.count(Replica.id).label("n"), func.sum(Block.nbytes).label("kv"),
                     func.sum(Replica.reserved_bytes).label("held"))
              .join(Block, Block.id == Replica.block_id)
              .where(Replica.state.in_(VISIBLE)).group_by(Replica.tier_id).subquery())
    query = (select(Tier, Worker, *(func.coalesce(c, 0) for c in (counts.c.n, counts.c.kv, counts.c.held)))
             .join(Worker, Tier.worker_id == Worker.id).outerjoin(counts, counts.c.tier_id == Tier.id)
             .order_by(Worker.name, Tier.kind))
    return [(t, w, int(n), int(kv), int(held)) for t, w, n, kv, held in session.execute(query)]


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


def namespace_usage(session: Session) -> dict[str, dict[str, tuple[int, int]]]:
    """namespace id -> tier kind -> (visible replicas, their bytes)."""
    query = (select(Block.namespace_id, Tier.kind, func.count(Replica.id), func.sum(Replica.reserved_bytes))
             .join(Block, Replica.block_id == Block.id).join(Tier, Replica.tier_id == Tier.id)
             .where(Replica.state.in_(VISIBLE)).group_by(Block.namespace_id, Tier.kind))
    usage: dict[str, dict[str, tuple[int, int]]] = {}
    for namespace_id, kind, n, nbytes in session.execute(query):
        usage.setdefault(namespace_id, {})[kind] = (int(n), int(nbytes or 0))
    return usage


def visible_replica_rows(session: Session, namespace_id: str | None) -> list[Replica]:
    query = select(Replica).join(Block, Replica.block_id == Block.id).where(Replica.state.in_(VISIBLE))
    if namespace_id is not None:
        query = query.where(Block.namespace_id == namespace_id)
    return list(session.scalars(query))


def durable_replicas_of_worker(session: Session, worker_id: int) -> list[tuple[Replica, Tier, Block]]:
    query = (select(Replica, Tier, Block).join(Tier, Replica.tier_id == Tier.id)
             .join(Block, Replica.block_id == Block.id)
             .where(Tier.worker_id == worker_id, Tier.kind.not_in(MEMORY)))
    return list(session.execute(query).tuples())


def recompute_used(session: Session, tier: Tier) -> None:
    tier.used_bytes = session.scalar(select(func.coalesce(func.sum(Replica.reserved_bytes), 0))
                                     .where(Replica.tier_id == tier.id)) or 0


def add_grant(session: Session, tier_id: int, epoch: int, token: str, runs: list, now: float) -> None:
    session.add(Grant(tier_id=tier_id, epoch=epoch, token=token, runs=runs, created_at=now))


def grants(session: Session) -> list[Grant]:
    return list(session.scalars(select(Grant)))


def drop_grants(session: Session, tier_ids: list[int]) -> None:
    """A worker's new epoch voids what it granted before."""
    if tier_ids:
        session.execute(delete(Grant).where(Grant.tier_id.in_(tier_ids)))


def pages_in_use(session: Session, tier_id: int, epoch: int):
    """Page runs of every replica of a memory tier written in this epoch (any state), streamed through
    the driver (a restart reads every replica of a tier here)."""
    for batch in direct.stream(session, "SELECT pages FROM replicas WHERE tier_id = ? AND epoch = ?", (tier_id, epoch)):
        for pages, in batch:
            yield direct.runs_value(pages)


def handoff_rows(session: Session, keys: list[str]) -> list[HandoffRow]:
    """The hand-offs named "<namespace>/<id>" that are still kept."""
    pairs = [tuple(k.split("/", 1)) for k in keys if "/" in k]
    rows = []
    for chunk in chunks(pairs):
        rows += session.scalars(select(HandoffRow).where(
            tuple_(HandoffRow.namespace_id, HandoffRow.handoff_id).in_(chunk)))
    return rows


def delete_handoffs_before(session: Session, before: float) -> int:
    return session.execute(delete(HandoffRow).where(HandoffRow.committed_at < before)).rowcount or 0


def recent_handoffs(session: Session, since: float, limit: int) -> list[HandoffRow]:
    """The newest hand-offs committed after `since`, oldest first."""
    rows = list(session.scalars(select(HandoffRow).where(HandoffRow.committed_at >= since)
                                .order_by(HandoffRow.committed_at.desc()).limit(limit)))
    return rows[::-1]
