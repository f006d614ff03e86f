"""The lookup index: committed blocks and their readable replicas, in memory.

    index.rebuild(session)                   # at start, from SQL; `ready` is False until then
    index.duplicates                         # what the last rebuild found: older block id -> the kept one
    index.reload(session, block_ids)         # after a commit that touched these blocks
    index.reload_topology(session)           # after a commit that touched workers or tiers
    index.workers / index.tiers / index.tiers_of(worker_id)   # that topology: {id: view}, {kind: TierView}
    index.follow_commit(sessions, touched, topology, committed)   # the writer's after-commit: all three
    index.lookup(namespace_id, hashes) -> [Hit]   # leading blocks with a readable replica; no lock, no SQL
    index.count(namespace_id, hashes) -> (hits, {kind: hits}, [(kind, n)])   # the same, without locations
    index.ids(namespace_id, hashes) -> {hash: block id}   # the blocks it holds, readable or not
    index.id_of(namespace_id, hash) -> block id | None     # one of them (a parent's id)
    index.record(entries)                         # a load read them: for the access statistics
    index.drain_accesses() -> (counts, entries)   # what loads read since

SQL is the durable record; this is a copy the writer brings up to date after each group commit and
before it answers the callers, so a lookup never sees a block before its commit is durable and a
caller's own commit is visible to its next lookup. It is also the authority for uniqueness: no SQL
index keeps one row per (namespace, hash), a save asks the index, and a rebuild meets the rare
duplicate rows (a block saved again while its old row held no readable replica) and keeps the
newest. Readers run on any thread without a lock: every update replaces whole values (an entry,
the topology dicts), which other threads see atomically.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from operator import itemgetter

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvstore.core import heap, tiers
from kvstore.directory.db import direct
from kvstore.directory.db.models import Tier, Worker
from kvstore.directory.db.models.replica import VISIBLE
from kvstore.directory.db.views import Entry, Hit, ReplicaView, TierView, WorkerView

log = logging.getLogger(__name__)

CHUNK = 500  # ids per IN list
_BLOCK_ID, _HOME = itemgetter(0), itemgetter(6)  # of an Entry
REBUILD_BATCH = 20_000  # rows read and applied at a time when the index is built


_ID, _NAMESPACE, _HASH, _NBYTES, _CHECKSUM, _REPLICAS = range(6)  # a stored entry: an Entry's fields,
# except that one replica is kept as itself, not in a tuple of one (`_replicas`)
_TIER, _EPOCH = 1, 2  # of a stored replica (a ReplicaView's fields)


class Index:
    def __init__(self, on_change=None) -> None:
        self.on_change = on_change  # [(id, parent id, namespace, hash, added, removed tier ids)], once started
        self.ready = False
        self._blocks: dict[str, dict[str, tuple]] = {}  # namespace -> hash -> entry (an Entry's fields)
        self._by_id: dict[int, tuple] = {}
        self.tiers: dict[int, TierView] = {}
        self.workers: dict[int, WorkerView] = {}
        self._own: dict[int, dict[str, TierView]] = {}  # worker id -> its tiers by kind
        self._counts: Counter = Counter()  # block id -> hits since the last drain, deepest first seen first
        self._hits: dict[int, tuple] = {}  # block id -> its entry when last hit
        self._readable: dict[int, tuple] = {}  # tier id -> (tier, worker, the epoch a replica needs or None)
        self._readable_homes: set[tuple] = set()  # (tier id, that epoch)
        self._homes: dict[tuple, tuple] = {}  # each home once
        self._sizes: dict[int, int] = {}  # each block size once (32 bytes a block)
        self._owed_lock = threading.Lock()
        self._owed: tuple[set[int], bool] = (set(), False)  # committed, not yet read back: blocks, topology
        self.duplicates: dict[int, int] = {}  # found by the last rebuild: older row's id -> the newest's
        self._rebuilding = False

    @property
    def num_blocks(self) -> int:
        return len(self._by_id)

    # ---- reads (any thread) ----------------------------------------------------------------

    def contents(self) -> tuple[dict[str, dict[str, tuple]], dict[int, tuple]]:
        """Every entry, by namespace and hash (namespaces that hold one) and by block id: two indexes
        that know the same blocks and replicas compare equal. For checks, not for the hot path."""
        return {ns: dict(by_hash) for ns, by_hash in self._blocks.items() if by_hash}, dict(self._by_id)

    def lookup(self, namespace_id: str, hashes: list[str]) -> list[Hit]:
        entries, homes = self._leading(namespace_id, hashes)
        hits = []
        for entry, home in zip(entries, homes):
            tier, worker, _ = self._readable[home[0]]
            replica = next(r for r in _replicas(entry) if self._home(r) == home)
            hits.append(Hit(entry[_HASH], entry[_ID], entry[_NBYTES], entry[_CHECKSUM], replica[0], entry, replica,
                            tier, worker))
        return hits

    def count(self, namespace_id: str, hashes: list[str]) -> tuple[int, dict[str, int], list[tuple[str, int]]]:
        """A lookup that needs no locations: the leading hits, their number per tier kind, and the kinds
        in prefix order, run-length encoded. The hot path of every engine's scheduler: no Hit is built."""
        entries, homes = self._leading(namespace_id, hashes)
        runs = tiers.tier_runs(homes, lambda home: self._readable[home[0]][0].kind)
        by_kind: dict[str, int] = {}
        for kind, n in runs:
            by_kind[kind] = by_kind.get(kind, 0) + n
        return len(entries), by_kind, runs

    def readable(self, namespace_id: str, hashes: list[str]) -> set[str]:
        """Which of `hashes` (anywhere in the list) have a readable replica."""
        blocks = self._blocks.get(namespace_id)
        if not blocks:
            return set()
        homes = self._readable_homes
        return {h for h, entry in zip(hashes, map(blocks.get, hashes))
                if entry is not None and (_HOME(entry) in homes or self._best(entry) is not None)}

    def ids(self, namespace_id: str, hashes: list[str]) -> dict[str, int]:
        """hash -> block id of those of `hashes` the index holds (readable or not): what a save and an
        adoption ask instead of SQL, which keeps no index on hashes."""
        blocks = self._blocks.get(namespace_id)
        if not blocks:
            return {}
        return {h: entry[_ID] for h, entry in zip(hashes, map(blocks.get, hashes)) if entry is not None}

    def _leading(self, namespace_id: str, hashes: list[str]) -> tuple[list[tuple], list[tuple]]:
        """The leading blocks with a readable replica, and the home of the replica each is read from.
        Mostly passes in C: the entries up to the first miss, and which of them can be read from
        their best replica; only a block whose best replica cannot be read is looked at in Python."""
        blocks = self._blocks.get(namespace_id)
        if not blocks:
            return [], []
        entries = list(map(blocks.get, hashes))
        if None in entries:
            entries = entries[: entries.index(None)]
        homes = list(map(_HOME, entries))
        readable = list(map(self._readable_homes.__contains__, homes))
        if False not in readable:
            return entries, homes
        k = readable.index(False)
        for entry in entries[k:]:
            best = self._best(entry)
            if best is None:
                break
            homes[k] = self._home(best)
            k += 1
        return entries[:k], homes[:k]

    def record(self, entries: list[tuple]) -> None:
        """Count these blocks as read (a load pinned them) in the access statistics, flushed to SQL
        in batches off the request path. A lookup is a question, not an access: it counts nothing
        (a scheduler may ask again for the same waiting request). C-level dict updates."""
        if entries:
            deepest_first = entries[::-1]
            ids = list(map(_BLOCK_ID, deepest_first))
            self._counts.update(ids)
            self._hits.update(zip(ids, deepest_first))

    def drain_accesses(self) -> tuple[Counter, dict[int, Entry]]:
        counts, hits = self._counts, self._hits
        self._counts, self._hits = Counter(), {}
        return counts, {block_id: Entry(*e[:_REPLICAS], tuple(map(ReplicaView.of, _replicas(e))), _HOME(e))
                        for block_id, e in hits.items()}

    # ---- updates (the writer thread, or start-up) -----------------------------------------------

    def rebuild(self, session: Session) -> None:
        """Everything from SQL, streamed in block order (a million blocks need no million rows in
        memory at once), then frozen out of the garbage collector's sight (`core/heap.py`). Rows of one
        (namespace, hash) met again are duplicates: the newest (highest id) is kept, the others are
        left in `duplicates` for the leader to merge (`repository.merge_blocks`)."""
        self.reload_topology(session)
        self._blocks, self._by_id = {}, heap.frozen_dict()
        self.duplicates, self._rebuilding = {}, True
        try:
            held: list = []  # the last block's rows of a batch: the next batch may hold more of its replicas
            for batch in direct.stream(session, _REBUILD, (), REBUILD_BATCH):
                rows = held + batch
                cut = len(rows)
                while cut and rows[cut - 1][0] == rows[-1][0]:
                    cut -= 1
                self._apply(_visible(rows[:cut]), set(), None)
                held = rows[cut:]
            self._apply(_visible(held), set(), None)
        finally:
            self._rebuilding = False
        if self.duplicates:
            log.warning("the index's rebuild found %d duplicate block rows (a newer row of the same hash "
                        "is kept)", len(self.duplicates))
        heap.freeze()
        self.ready = True

    @property
    def owes(self) -> bool:
        """Whether committed blocks wait to be read back (a read after a commit failed)."""
        return bool(self._owed[0] or self._owed[1])

    def follow_commit(self, sessions, touched: set[int], topology: bool, committed: list) -> None:
        """After a group commit (the writer's thread): add the replicas it committed, then read back every
        other block it touched (that read is the final word). A read that fails (the database went away
        after the COMMIT) is owed: the next commit's read, or the next call with nothing new (the
        reaper's round, as a job: only the writer's thread updates the index), reads them again."""
        if committed:
            self.add(committed)
        with self._owed_lock:
            owed, self._owed = self._owed, (set(), False)
        touched, topology = touched | owed[0], topology or owed[1]
        if not (touched or topology):
            return
        try:
            with sessions() as session:
                if topology:
                    self.reload_topology(session)
                if touched:
                    self.reload(session, touched)
        except Exception as exc:  # noqa: BLE001 (owed, read again later; the commit itself stands)
            log.warning("the index could not read back %d committed blocks (again later): %s", len(touched), exc)
            with self._owed_lock:
                self._owed = (self._owed[0] | touched, self._owed[1] or topology)

    def reload(self, session: Session, block_ids: set[int]) -> None:
        ids, changes = sorted(block_ids), [] if self.on_change else None  # what changed, told at the end
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            found = direct.rows(session, _RELOAD.format(direct.marks(len(chunk))), tuple(chunk))
            self._apply(_visible(found), set(chunk), changes)
        if changes:
            self.on_change(changes)

    def add(self, rows: list[tuple]) -> None:
        """Replicas just committed READY (rows as `_RELOAD` reads them), merged into their blocks' entries."""
        merged, changes = [], [] if self.on_change else None
        for row in rows:
            block_id, namespace_id, block_hash, parent, nbytes, checksum, replica_id, tier_id, epoch, pages = row
            old = self._blocks.get(namespace_id, {}).get(block_hash)
            if old is None and block_id not in self._by_id:  # a new block (a save): no merge, no sort
                self._new(row, changes)
                continue
            others = [r for r in _replicas(old) if r[0] != replica_id] if old is not None else []
            merged += [(block_id, namespace_id, block_hash, parent, nbytes, checksum, *r[:3], r[3:]) for r in others]
            merged.append(row)
        if merged:
            self._apply(merged, set(), changes)
        if changes:
            self.on_change(changes)

    def _new(self, row: tuple, changes: list | None) -> None:
        block_id, namespace_id, block_hash, parent, nbytes, checksum, replica_id, tier_id, epoch, pages = row
        namespace_id = sys.intern(namespace_id)
        replica = (replica_id, tier_id, epoch, *_flat(pages))
        entry = (block_id, namespace_id, block_hash, self._sizes.setdefault(nbytes, nbytes), checksum, replica,
                 self._home(replica))
        self._namespace(namespace_id)[block_hash] = entry
        self._by_id[block_id] = entry
        if changes is not None:
            changes.append((block_id, self.id_of(namespace_id, parent), namespace_id, block_hash, (tier_id,), ()))

    def reload_topology(self, session: Session) -> None:
        workers = {w.id: WorkerView(w.id, w.name, w.agent_name, w.epoch, w.state, w.control_url,
                                    tuple(w.backends or ()))
                   for w in session.execute(select(Worker.id, Worker.name, Worker.agent_name, Worker.epoch,
                                                   Worker.state, Worker.control_url, Worker.backends))}
        self.set_topology(workers, {t.id: TierView(*t) for t in session.execute(
            select(Tier.id, Tier.worker_id, Tier.kind, Tier.page_bytes, Tier.base_addr, Tier.capacity_bytes,
                   Tier.device))})

    def set_topology(self, workers: dict[int, WorkerView], tiers_: dict[int, TierView]) -> None:
        """Workers and tiers, and from them which tiers can be read: objects in S3 whatever their
        worker's state, NVMe while its worker lives, memory only in the epoch that wrote it."""
        readable = {}
        for tier in tiers_.values():
            worker = workers[tier.worker_id]
            if tier.kind == "s3" or worker.state != "dead":
                readable[tier.id] = (tier, worker, worker.epoch if tier.kind in tiers.MEMORY else None)
        own: dict[int, dict[str, TierView]] = {}
        for tier in tiers_.values():
            own.setdefault(tier.worker_id, {})[tier.kind] = tier
        self.workers, self.tiers, self._readable, self._own = workers, tiers_, readable, own
        self._readable_homes = {(tier_id, epoch) for tier_id, (_, _, epoch) in readable.items()}

    def tiers_of(self, worker_id: int) -> dict[str, TierView]:
        """A worker's tiers by kind, as of the last commit (moves read topology here, not from SQL)."""
        return self._own.get(worker_id, {})

    def _home(self, replica: tuple) -> tuple[int, int | None]:
        """(tier id, the epoch it was written in if its tier is memory, else None), one shared tuple
        per value: a replica is readable when its home is one of the readable homes."""
        tier = self.tiers.get(replica[_TIER])
        home = (replica[_TIER], replica[_EPOCH] if tier is not None and tier.kind in tiers.MEMORY else None)
        return self._homes.setdefault(home, home)

    def best(self, entry: tuple) -> tuple[ReplicaView, TierView, WorkerView] | None:
        """The first readable replica of `entry` (an Entry, or one as stored), with its tier and worker."""
        replica = self._best(entry)
        if replica is None:
            return None
        tier, worker, _ = self._readable[replica[_TIER]]
        return replica if isinstance(replica, ReplicaView) else ReplicaView.of(replica), tier, worker

    def _best(self, entry: tuple) -> tuple | None:
        """The first readable replica of a stored entry (they are kept best tier first)."""
        for replica in _replicas(entry):
            where = self._readable.get(replica[_TIER])
            if where is not None and (where[2] is None or where[2] == replica[_EPOCH]):
                return replica
        return None

    def _namespace(self, namespace_id: str) -> dict[str, tuple]:
        """A namespace's hash -> entry dict, kept once made; frozen out of the garbage collector's sight
        when made (once per namespace): no full collection walks its millions of entries."""
        if namespace_id not in self._blocks:
            self._blocks[namespace_id] = heap.frozen_dict()
        return self._blocks[namespace_id]

    def _forget(self, block_id: int, changes: list | None) -> None:
        old = self._by_id.pop(block_id, None)
        if old is None:
            return
        namespace_id, block_hash = old[_NAMESPACE], old[_HASH]
        if self._blocks.get(namespace_id, {}).get(block_hash) is old:
            del self._blocks[namespace_id][block_hash]
        if changes is not None:
            changes.append((block_id, None, namespace_id, block_hash, (), [r[_TIER] for r in _replicas(old)]))

    def id_of(self, namespace_id: str, block_hash: str | None) -> int | None:
        """The block id of a hash the index holds (readable or not), else None: a parent's id, where SQL
        has no index to join a block to its parent by hash."""
        entry = self._blocks.get(namespace_id, {}).get(block_hash) if block_hash else None
        return entry[_ID] if entry is not None else None

    def _apply(self, rows, asked: set[int], changes: list | None) -> None:
        """Replace the entries of `rows`' blocks; blocks in `asked` with no row are gone. What changed
        is appended to `changes` (None: not collected)."""
        found: dict[int, tuple] = {}
        for block_id, namespace_id, block_hash, parent, nbytes, checksum, replica_id, tier_id, epoch, pages in rows:
            if block_id not in found:
                found[block_id] = (sys.intern(namespace_id), block_hash, parent, nbytes, checksum, [])
            found[block_id][5].append((replica_id, tier_id, epoch, *_flat(pages)))
        tiers_ = self.tiers
        for block_id in asked - set(found):
            self._forget(block_id, changes)
        for block_id, (namespace_id, block_hash, parent, nbytes, checksum, replicas) in found.items():
            replicas.sort(key=lambda r: tiers.PREFERENCE[tiers_[r[_TIER]].kind] if r[_TIER] in tiers_ else 99)
            previous = self._by_id.get(block_id)
            if previous is not None and (previous[_NAMESPACE], previous[_HASH]) != (namespace_id, block_hash):
                self._forget(block_id, changes)  # the writer gave a deleted block's id to this new one
            by_hash = self._namespace(namespace_id)
            old = by_hash.get(block_hash)
            if old is not None and old[_ID] != block_id:  # the block was deleted and saved again
                self._by_id.pop(old[_ID], None)
                if self._rebuilding:  # both rows are there: rows come in id order, this one is newer
                    self.duplicates[old[_ID]] = block_id
            entry = (block_id, namespace_id, block_hash, self._sizes.setdefault(nbytes, nbytes), checksum,
                     replicas[0] if len(replicas) == 1 else tuple(replicas), self._home(replicas[0]))
            by_hash[block_hash] = entry
            self._by_id[block_id] = entry
            if changes is not None:
                before = {r[_TIER] for r in _replicas(old)} if old is not None else set()
                after = {r[_TIER] for r in replicas}
                if before != after:
                    changes.append((block_id, self.id_of(namespace_id, parent), namespace_id, block_hash,
                                    sorted(after - before), sorted(before - after)))


def _replicas(entry: tuple) -> tuple:
    """An entry's replicas, best tier first. A block with one replica (most blocks) keeps it in place of
    the tuple of them: 48 bytes less a block."""
    replicas = entry[_REPLICAS]
    return (replicas,) if type(replicas[0]) is int else replicas


def _visible(rows: list[tuple]) -> list[tuple]:
    """`_REBUILD`'s rows of replicas in a readable state, their pages read, without the state."""
    return [(*row[:9], direct.runs_value(row[9])) for row in rows if row[10] in VISIBLE]


def _flat(pages) -> tuple:
    """Page runs as one flat tuple, from [[first, count], ...] (SQL) or already flat (the index)."""
    if len(pages) == 1:  # one run, [[first, count]]: most blocks
        return tuple(pages[0])
    if pages and isinstance(pages[0], (list, tuple)):
        return tuple(x for run in pages for x in run)
    return tuple(pages)


_REBUILD = ("SELECT b.id, b.namespace_id, b.hash, b.parent, b.nbytes, b.checksum, r.id, r.tier_id, r.epoch, r.pages, "
            "r.state FROM blocks b JOIN replicas r ON r.block_id = b.id WHERE b.checksum IS NOT NULL ORDER BY b.id")
# every committed block's replicas, one row each, the state compared in Python: a filter on it would walk
# the state index and sort every row before the first came back (`direct.py`); `_RELOAD` is it for some blocks
_RELOAD = _REBUILD.replace("ORDER BY b.id", "AND b.id IN ({})")
