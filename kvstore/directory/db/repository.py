"""SQL only: reads and writes of the directory's tables, no rules."""

from __future__ import annotations

import json
from typing import NamedTuple

from sqlalchemy import delete, func, select, tuple_
from sqlalchemy.orm import Session

from kvstore.core.tiers import MEMORY
from kvstore.directory.db.models import Block, Grant, HandoffRow, Lease, NamespaceRow, Replica, Tier, Worker
from kvstore.directory.db.models.replica import MOVING, READY, VISIBLE, WRITING

CHUNK = 500  # ids per IN list: PostgreSQL takes at most 65,535 parameters a statement


def touched(session: Session, block_ids) -> None:
    """Block rows a bulk statement changed, for the lookup index to reload after the commit (ORM
    flushes are noticed without this)."""
    session.info.setdefault("touched_blocks", set()).update(block_ids)


def chunks(values: list) -> list[list]:
    return [values[i : i + CHUNK] for i in range(0, len(values), CHUNK)]


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


def handoff(session: Session, key: str) -> HandoffRow | None:
    return session.get(HandoffRow, key)


def namespace_rows(session: Session) -> list[NamespaceRow]:
    return session.query(NamespaceRow).order_by(NamespaceRow.created_at).all()


def add_namespace(session: Session, namespace_id: str, spec: dict, now: float) -> None:
    session.add(NamespaceRow(id=namespace_id, spec=spec, created_at=now))


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
    found: dict[str, Block] = {}
    for chunk in chunks(hashes):
        query = select(Block).where(Block.namespace_id == namespace_id, Block.hash.in_(chunk))
        found.update((b.hash, b) for b in session.scalars(query))
    return found


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


class BlockRef(NamedTuple):
    id: int
    depth: int


def block_refs(session: Session, namespace_id: str, hashes: list[str]) -> dict[str, BlockRef]:
    """hash -> (id, depth) of the blocks the directory has, as plain rows."""
    found: dict[str, BlockRef] = {}
    for chunk in chunks(hashes):
        query = select(Block.hash, Block.id, Block.depth).where(Block.namespace_id == namespace_id,
                                                                Block.hash.in_(chunk))
        found.update((h, BlockRef(i, d)) for h, i, d in session.execute(query))
    return found


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


def driver(session: Session, sql: str) -> tuple:
    """The session's connection and `sql` (`?` placeholders) as its driver wants it, to run straight
    through the driver: not compiled again, no parameters processed per row (SQLAlchemy Core costs
    about ten microseconds a row). Pending ORM changes are flushed first, as `session.execute` would,
    so the statement runs after them."""
    session.flush()
    connection = session.connection()
    if connection.dialect.paramstyle in ("format", "pyformat"):
        sql = sql.replace("?", "%s")
    return connection, sql


def driver_many(session: Session, sql: str, rows: list[tuple]) -> None:
    """One statement for many rows (executemany) through the driver."""
    if rows:
        connection, sql = driver(session, sql)
        connection.exec_driver_sql(sql, rows)


def delete_orphan_blocks(session: Session, block_ids: list[int]) -> None:
    """Blocks whose last replica is gone leave the map."""
    has_replica = select(Replica.id).where(Replica.block_id == Block.id).exists()
    for chunk in chunks(block_ids):
        session.execute(delete(Block).where(Block.id.in_(chunk), ~has_replica))


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


def pinned_replica_ids(session: Session, replica_ids: list[int]) -> set[int]:
    pinned: set[int] = set()
    for chunk in chunks(replica_ids):
        pinned.update(session.scalars(select(Lease.replica_id).where(Lease.replica_id.in_(chunk))))
    return pinned


def replicas_in_state(session: Session, state: str) -> list[tuple[Replica, Tier, Worker]]:
    query = (select(Replica, Tier, Worker).join(Tier, Replica.tier_id == Tier.id)
             .join(Worker, Tier.worker_id == Worker.id).where(Replica.state == state))
    return list(session.execute(query).tuples())


def drop_replicas(session: Session, replica_ids: list[int]) -> None:
    for chunk in chunks(replica_ids):
        session.execute(delete(Lease).where(Lease.replica_id.in_(chunk)))
        gone = session.scalars(delete(Replica).where(Replica.id.in_(chunk)).returning(Replica.block_id)
                               .execution_options(synchronize_session=False))
        touched(session, gone)


def add_used(session: Session, deltas: dict[int, int]) -> None:
    """tier id -> bytes: one atomic `used_bytes = used_bytes + delta` per tier (no read-modify-write)."""
    driver_many(session, "UPDATE tiers SET used_bytes = used_bytes + ? WHERE id = ?",
                [(delta, tier_id) for tier_id, delta in deltas.items() if delta])


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


def pages_in_use(session: Session, tier_id: int, epoch: int) -> list[list]:
    """Page runs of every replica of a memory tier written in this epoch (any state)."""
    query = select(Replica.pages).where(Replica.tier_id == tier_id, Replica.epoch == epoch)
    return [pages for pages in session.scalars(query)]


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


ROWS_PER_INSERT = 500  # rows of one multi-row INSERT: 8 or 9 columns stay under every driver's parameter limit


def rows(session: Session, sql: str, params: tuple = ()) -> list[tuple]:
    connection, sql = driver(session, sql)
    return list(connection.exec_driver_sql(sql, params))


def marks(n: int) -> str:
    return ", ".join("?" * n)


def insert_blocks(session: Session, namespace_id: str, blocks: list[tuple], now: float) -> dict[str, int]:
    """(hash, parent, depth, nbytes, checksum) rows, committed; returns hash -> id. A block row that is
    already there (a replica of it is still being deleted) keeps its id and takes the new checksum."""
    ids: dict[str, int] = {}
    for start in range(0, len(blocks), ROWS_PER_INSERT):
        chunk = blocks[start : start + ROWS_PER_INSERT]
        values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, 0)"] * len(chunk))
        params = tuple(x for h, p, d, n, c in chunk for x in (namespace_id, h, p, d, n, c, now, now))
        ids.update((h, i) for i, h in rows(
            session, "INSERT INTO blocks (namespace_id, hash, parent, depth, nbytes, checksum, created_at, "
            f"last_access, hit_count) VALUES {values} ON CONFLICT (namespace_id, hash) DO NOTHING RETURNING id, hash",
            params))
    there = [b for b in blocks if b[0] not in ids]
    if there:
        for chunk in chunks([b[0] for b in there]):
            ids.update((h, i) for h, i in rows(
                session, f"SELECT hash, id FROM blocks WHERE namespace_id = ? AND hash IN ({marks(len(chunk))})",
                (namespace_id, *chunk)))
        driver_many(session, "UPDATE blocks SET checksum = ? WHERE id = ?", [(b[4], ids[b[0]]) for b in there])
    return ids


def insert_replicas(session: Session, replicas: list[tuple]) -> dict[int, int]:
    """(block id, tier id, epoch, token, pages, reserved bytes, created_at) rows, READY; returns block
    id -> replica id."""
    ids: dict[int, int] = {}
    for start in range(0, len(replicas), ROWS_PER_INSERT):
        chunk = replicas[start : start + ROWS_PER_INSERT]
        values = ", ".join([f"(?, ?, ?, '{READY}', ?, ?, ?, NULL, ?)"] * len(chunk))
        params = tuple(x for b, t, e, tok, pages, n, c in chunk for x in (b, t, e, tok, json.dumps(pages), n, c))
        ids.update((b, i) for i, b in rows(
            session, "INSERT INTO replicas (block_id, tier_id, epoch, state, token, pages, reserved_bytes, "
            f"expires_at, created_at) VALUES {values} RETURNING id, block_id", params))
    return ids
