"""The lookup index: committed blocks and their readable replicas, in memory.

    index.rebuild(session)                   # at start, from SQL; `ready` is False until then
    index.reload(session, block_ids)         # after a commit that touched these blocks
    index.reload_topology(session)           # after a commit that touched workers or tiers
    index.lookup(namespace_id, hashes) -> [Hit]   # leading blocks with a readable replica; no lock, no SQL
    index.drain_accesses() -> (counts, hits)      # what lookups found since, for the access statistics

SQL is the truth; this is a copy the writer brings up to date after each group
commit and before it answers the callers, so a lookup never sees a block
before its commit is durable and a caller's own commit is visible to its next
lookup. Readers run on any thread without a lock: every update replaces whole
values (an entry, the topology dicts), which other threads see atomically.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvstore.core import tiers
from kvstore.directory.models import Block, Replica, Tier, Worker
from kvstore.directory.models.replica import VISIBLE

CHUNK = 500  # ids per IN list
REBUILD_BATCH = 20_000  # rows read and applied at a time when the index is built


class TierView(NamedTuple):
    id: int
    worker_id: int
    kind: str
    page_bytes: int
    base_addr: int


class WorkerView(NamedTuple):
    id: int
    name: str
    agent_name: str
    epoch: int
    state: str


class ReplicaView(NamedTuple):
    id: int
    tier_id: int
    epoch: int
    pages: tuple  # (first, count, first, count, ...): flat, a tuple less per block

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self.pages[::2], self.pages[1::2]))


class Entry(NamedTuple):
    block_id: int
    namespace_id: str
    hash: str
    nbytes: int
    checksum: str
    replicas: tuple  # ReplicaViews, best tier first


class Hit(NamedTuple):
    """One leading block of a lookup and the replica a reader gets."""
    hash: str
    entry: Entry
    replica: ReplicaView
    tier: TierView
    worker: WorkerView


class Index:
    def __init__(self, on_change=None) -> None:
        self.on_change = on_change  # (key, parent, added tier ids, removed tier ids), after start-up
        self.ready = False
        self._blocks: dict[str, dict[str, Entry]] = {}  # namespace -> hash -> entry
        self._by_id: dict[int, Entry] = {}
        self.tiers: dict[int, TierView] = {}
        self.workers: dict[int, WorkerView] = {}
        self._counts: Counter = Counter()  # block id -> hits since the last drain, deepest first seen first
        self._hits: dict[int, Hit] = {}  # block id -> its latest hit

    @property
    def num_blocks(self) -> int:
        return len(self._by_id)

    # ---- reads (any thread) ----------------------------------------------------------------

    def lookup(self, namespace_id: str, hashes: list[str], record: bool = True) -> list[Hit]:
        blocks = self._blocks.get(namespace_id)
        if not blocks:
            return []
        tiers_, workers = self.tiers, self.workers
        hits = []
        for h in hashes:
            entry = blocks.get(h)
            best = _best(entry, tiers_, workers) if entry is not None else None
            if best is None:
                break
            hits.append(Hit(h, entry, best[0], best[1], best[2]))
        if record:
            self.record(hits)
        return hits

    def record(self, hits: list[Hit]) -> None:
        """Count these hits in the access statistics (flushed to SQL in batches, off the request
        path). C-level dict updates: a few microseconds for a long prefix."""
        if hits:
            deepest_first = hits[::-1]
            ids = [h.entry.block_id for h in deepest_first]
            self._counts.update(ids)
            self._hits.update(zip(ids, deepest_first))

    def drain_accesses(self) -> tuple[Counter, dict[int, Hit]]:
        counts, hits = self._counts, self._hits
        self._counts, self._hits = Counter(), {}
        return counts, hits

    # ---- updates (the writer thread, or start-up) -----------------------------------------------

    def rebuild(self, session: Session) -> None:
        """Everything from SQL, streamed in block order (a million blocks need no million rows in
        memory at once). The entries are then frozen out of the cyclic garbage collector's sight:
        they hold no cycles, and a full collection over millions of them would stall every request."""
        self.reload_topology(session)
        self._blocks, self._by_id = {}, {}
        batch: list = []
        result = session.execute(_rows_query().order_by(Block.id), execution_options={"yield_per": REBUILD_BATCH})
        for row in result:
            if len(batch) >= REBUILD_BATCH and row[0] != batch[-1][0]:
                self._apply(batch, set(), notify=False)
                batch = []
            batch.append(row)
        self._apply(batch, set(), notify=False)
        gc.collect()
        gc.freeze()
        self.ready = True

    def reload(self, session: Session, block_ids: set[int]) -> None:
        ids = sorted(block_ids)
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            self._apply(session.execute(_rows_query().where(Block.id.in_(chunk))), set(chunk),
                        notify=self.on_change is not None)

    def add(self, rows: list[tuple]) -> None:
        """Replicas just committed READY, as (block id, namespace, hash, parent, nbytes, checksum,
        replica id, tier id, epoch, pages): merged into their blocks' entries."""
        merged = []
        for block_id, namespace_id, block_hash, parent, nbytes, checksum, replica_id, tier_id, epoch, pages in rows:
            old = self._blocks.get(namespace_id, {}).get(block_hash)
            others = [r for r in old.replicas if r.id != replica_id] if old is not None else []
            merged += [(block_id, namespace_id, block_hash, parent, nbytes, checksum, r.id, r.tier_id, r.epoch,
                        r.pages) for r in others]
            merged.append((block_id, namespace_id, block_hash, parent, nbytes, checksum, replica_id, tier_id, epoch,
                           pages))
        self._apply(merged, set(), notify=self.on_change is not None)

    def reload_topology(self, session: Session) -> None:
        self.workers = {w.id: WorkerView(w.id, w.name, w.agent_name, w.epoch, w.state)
                        for w in session.execute(select(Worker.id, Worker.name, Worker.agent_name, Worker.epoch,
                                                        Worker.state))}
        self.tiers = {t.id: TierView(t.id, t.worker_id, t.kind, t.page_bytes, t.base_addr)
                      for t in session.execute(select(Tier.id, Tier.worker_id, Tier.kind, Tier.page_bytes,
                                                      Tier.base_addr))}

    def _apply(self, rows, asked: set[int], notify: bool) -> None:
        """Replace the entries of the blocks in `rows`; blocks in `asked` with no row are gone."""
        found: dict[int, tuple] = {}
        for block_id, namespace_id, block_hash, parent, nbytes, checksum, replica_id, tier_id, epoch, pages in rows:
            if block_id not in found:
                found[block_id] = (sys.intern(namespace_id), block_hash, parent, nbytes, checksum, [])
            found[block_id][5].append(ReplicaView(replica_id, tier_id, epoch, _flat(pages)))
        tiers_ = self.tiers
        for block_id in asked - set(found):
            old = self._by_id.pop(block_id, None)
            if old is not None:
                by_hash = self._blocks.get(old.namespace_id, {})
                by_hash.pop(old.hash, None)
                if not by_hash:
                    self._blocks.pop(old.namespace_id, None)
                if notify:
                    self.on_change(f"{old.namespace_id}/{old.hash}", None, [], [r.tier_id for r in old.replicas])
        for block_id, (namespace_id, block_hash, parent, nbytes, checksum, replicas) in found.items():
            replicas.sort(key=lambda r: tiers.PREFERENCE[tiers_[r.tier_id].kind] if r.tier_id in tiers_ else 99)
            by_hash = self._blocks.setdefault(namespace_id, {})
            old = by_hash.get(block_hash)
            entry = Entry(block_id, namespace_id, block_hash, nbytes, checksum, tuple(replicas))
            by_hash[block_hash] = entry
            self._by_id[block_id] = entry
            if notify:
                before = {r.tier_id for r in old.replicas} if old is not None else set()
                after = {r.tier_id for r in replicas}
                if before != after:
                    self.on_change(f"{namespace_id}/{block_hash}", f"{namespace_id}/{parent}" if parent else None,
                                   sorted(after - before), sorted(before - after))


def _flat(pages) -> tuple:
    """Page runs as one flat tuple, from [[first, count], ...] (SQL) or already flat (the index)."""
    if pages and isinstance(pages[0], (list, tuple)):
        return tuple(x for run in pages for x in run)
    return tuple(pages)


def _rows_query():
    """Committed blocks with a readable-state replica, one row per replica."""
    return (select(Block.id, Block.namespace_id, Block.hash, Block.parent, Block.nbytes, Block.checksum, Replica.id,
                   Replica.tier_id, Replica.epoch, Replica.pages)
            .join(Replica, Replica.block_id == Block.id)
            .where(Replica.state.in_(VISIBLE), Block.checksum.is_not(None)))


def _best(entry: Entry, tiers_: dict[int, TierView], workers: dict[int, WorkerView]):
    """The first readable replica (they are kept best tier first): READY or MOVING on a live worker,
    a memory tier only in the epoch that wrote it."""
    for replica in entry.replicas:
        tier = tiers_.get(replica.tier_id)
        if tier is None:
            continue
        worker = workers[tier.worker_id]
        if tier.kind != "s3" and worker.state == "dead":
            continue
        if tier.kind in tiers.MEMORY and replica.epoch != worker.epoch:
            continue
        return replica, tier, worker
    return None
