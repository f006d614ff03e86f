"""Saves: prepare_store -> (the engine writes) -> complete_store | abort_store; renew.

    store.prepare(req) -> StorePrepared      # admission, placement, pages from the page pool
    store.complete_async(req) -> StoreCompleted    # blocks, checksums and READY replicas, in one job
    store.abort(token) -> n
    store.renew(token) -> Renewed            # leases and reservations alike
    store.expire(tx, now) -> n               # the reaper: reservations past their expiry

A save makes no call to a worker: pages come from the page credit the workers
granted (`workers/credit.py`). Only when that credit cannot hold the request does the save
first make room (demotion, outside every job) and then place. What prepare
hands out is a reservation in memory (`reservations`); complete writes the
blocks to SQL in one job, so a save costs one commit.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple
from urllib.parse import urlsplit

from kvstore.core import specs, tiers
from kvstore.core.errors import KVStoreError
from kvstore.core.pages import pages_for
from kvstore.directory.db import saves as sql
from kvstore.directory.db import direct, repository as repo
from kvstore.directory.db.index import Index
from kvstore.directory.db import views
from kvstore.directory.db.views import WorkerView
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.core.pace import paced, tier_sized
from kvstore.directory.tier_policies import TierPolicies, block_key
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.saves.reservations import Reservation, Reservations, Reserved
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.db.writer import Tx, Writer
from kvstore.policies import Admit, Throttled
from kvstore.policies.hints import NONE as NO_HINTS
from kvstore.policies.hints import Hints

LOOP_PREPARE_BLOCKS = 1024  # longer saves are prepared on a thread: the event loop answers lookups meanwhile
EXPIRED = "the reservation expired before completion and was rolled back"
COMPLETED_KEPT = 16_384  # completions remembered: a retry whose first answer was lost learns what it did


class Store:
    def __init__(self, writer: Writer, index: Index, pools: PagePools, reservations: Reservations,
                 policies: TierPolicies, metrics: DirectoryMetrics, settings: DirectorySettings,
                 make_room: Callable[[int, int, int], None], clock: Callable[[], float]) -> None:
        self._write, self._write_async = writer.run, writer.run_async
        self._index = index
        self._pools = pools
        self._policies = policies
        self._metrics = metrics
        self._settings = settings
        self._make_room = make_room  # (tier id, worker id, bytes): demote until they fit
        self._clock = clock
        self.reservations = reservations
        self._lock = threading.Lock()
        self._completed_tokens: OrderedDict[str, tuple] = OrderedDict()  # token -> what its completion said

    # ---- prepare ---------------------------------------------------------------------------

    def prepare(self, req) -> dict:
        """Namespace and sizes are checked by the caller. When the page credit cannot hold the new
        blocks, room is made first (by demotion, through workers), then the blocks are placed."""
        with tier_sized(len(req.blocks) > LOOP_PREPARE_BLOCKS):
            prepared = self._prepare(req, room_first=True)
            return self._after_room(req, prepared) if isinstance(prepared, _NeedRoom) else self._prepared(prepared)

    async def prepare_async(self, req) -> dict:
        """`prepare` for the event loop: in memory, so answered there; a long request, making room
        (worker calls), and a decision whose locks another thread holds (a policy syncing a whole
        tier from SQL, a large save's prepare) run on a thread: the loop never waits on a lock."""
        if len(req.blocks) <= LOOP_PREPARE_BLOCKS:
            prepared = self._prepare(req, room_first=True, wait=False)
            if isinstance(prepared, _NeedRoom):
                return await asyncio.to_thread(self._after_room, req, prepared)
            if prepared is not _BUSY:
                return self._prepared(prepared)
        return await asyncio.to_thread(self.prepare, req)

    def _after_room(self, req, need: _NeedRoom) -> dict:
        self._make_room(need.tier_id, need.worker_id, need.nbytes)
        return self._prepared(self._prepare(req, room_first=False))

    def _prepared(self, prepared: dict) -> dict:
        self._metrics.count_store_decisions(prepared["blocks"])
        return prepared

    def _prepare(self, req, room_first: bool, wait: bool = True):
        """Decide every block and reserve pages for the new ones, with no SQL: which blocks exist comes
        from the index, which are being written from the reservations. The writer adds a completed
        save's blocks to the index before it drops their reservation, so asking the reservations
        first never misses a block in between. One decision at a time (no two saves reserve the same
        block), holding the policies' lock throughout; `wait` False: _BUSY if either lock is taken."""
        if not self._lock.acquire(blocking=wait):
            return _BUSY
        try:
            if not self._policies.lock.acquire(blocking=wait):
                return _BUSY
            try:
                return self._decide(req, room_first)
            finally:
                self._policies.lock.release()
        finally:
            self._lock.release()

    def _decide(self, req, room_first: bool):
        now = self._clock()
        hashes = [b.hash for b in req.blocks]
        writing = {h for h in paced(hashes) if self._being_written(req.namespace_id, h, now)}
        ready = self._index.readable(req.namespace_id, hashes)
        decisions: dict[str, dict] = {}  # hash -> a StoreDecision as plain values
        wanted = []
        for block in paced(req.blocks):
            if block.hash in ready:
                decisions[block.hash] = {"hash": block.hash, "status": "exists"}
            elif block.hash in writing:
                decisions[block.hash] = {"hash": block.hash, "status": "in_progress"}
            else:
                wanted.append(block)
        token = secrets.token_hex(16)
        expires_at = now + self._settings.reservation_ttl_s
        admitted = self._place(req.namespace_id, wanted, token, expires_at, decisions, room_first,
                               frozenset(req.hosts), _hints(req.hints), req.blocks[-1].hash)
        if isinstance(admitted, _NeedRoom):
            return admitted
        return {"token": token if admitted else None, "expires_at": expires_at if admitted else None,
                "blocks": [decisions[b.hash] for b in req.blocks]}

    def _being_written(self, namespace_id: str, block_hash: str, now: float) -> bool:
        """Another save holds a live reservation for the block (in time, in its worker's epoch)."""
        r = self.reservations.writer_of(namespace_id, block_hash)
        if r is None:
            return False
        if r.taken:  # its completion is committing
            return True
        if r.expires_at < now:
            return False
        worker = self._index.workers.get(r.worker_id)
        return worker is not None and worker.epoch == r.epoch

    def _place(self, namespace_id: str, wanted: list, token: str, expires_at: float, decisions: dict,
               room_first: bool, hosts: frozenset[str] = frozenset(), hints: Hints | None = None,
               tail: str | None = None) -> int | _NeedRoom:
        """Pages for `wanted` on the placement tier, from the page pool, as one reservation; fills
        `decisions`. With `room_first`, a request the pool cannot hold changes nothing and asks for
        room instead. `hints`: what the save says; `tail`: the hash of its last block (a save's
        tail until a later save names it as a parent)."""
        if not wanted:
            return 0
        choice = _placement(self._index, self._pools, hosts, sum(b.nbytes for b in wanted))
        if choice is None:
            for block in wanted:
                decisions[block.hash] = _rejected(block.hash, "no_worker")
            return 0
        tier, worker = choice
        need = sum(pages_for(b.nbytes, tier.page_bytes) for b in paced(wanted)) * tier.page_bytes
        if room_first and need > self._pools.free_bytes(tier.id, worker.epoch):
            return _NeedRoom(tier.id, worker.id, need)
        said = hints or NO_HINTS
        as_tail = said.as_tail(True)

        def hints_of(block_hash: str) -> Hints:  # what the save said; its tail is marked as one
            return as_tail if block_hash == tail else said

        keys = {b.hash: block_key(namespace_id, b.hash) for b in paced(wanted)}
        wanted = self._admitted(tier, wanted, decisions, keys, hints_of)
        placed, rejected = [], set()
        allocated = self._pools.allocate_many(tier.id, worker.epoch, [b.nbytes for b in wanted])
        for block, runs in paced(zip(wanted, allocated)):
            if runs is not None and block.parent in rejected:  # a suffix without its prefix is useless
                self._pools.free(tier.id, worker.epoch, runs)
                runs = None
            if runs is None:
                rejected.add(block.hash)
                pages = pages_for(block.nbytes, tier.page_bytes)
                room = self._pools.free_bytes(tier.id, worker.epoch) >= pages * tier.page_bytes
                decisions[block.hash] = _rejected(block.hash, "parent_rejected" if room else "no_space")
            else:
                placed.append(Reserved(block.hash, block.parent, block.nbytes, runs))
                decisions[block.hash] = {"hash": block.hash, "status": "admitted",
                                         "location": views.location(worker, tier, runs, block.nbytes)}
        if placed:
            self.reservations.add(Reservation(token, namespace_id, tier.id, worker.id, worker.epoch, tier.page_bytes,
                                              expires_at, placed))
            self._policies.expect(tier, [(namespace_id, b.hash, hints_of(b.hash)) for b in placed])
        return len(placed)

    def _admitted(self, tier: PlacementTier, wanted: list, decisions: dict, keys: dict, hints_of) -> list:
        """The blocks the tier's admission lets in; the others (and their suffixes) are rejected."""
        admitted, rejected = [], set()
        asked = self._policies.admit_many(tier, [(keys[b.hash], b.nbytes, hints_of(b.hash)) for b in paced(wanted)])
        for block, decision in paced(zip(wanted, asked)):
            if block.parent in rejected or not isinstance(decision, Admit):
                reason = ("parent_rejected" if block.parent in rejected else
                          "throttled" if isinstance(decision, Throttled) else "not_admitted")
                rejected.add(block.hash)
                decisions[block.hash] = _rejected(block.hash, reason, decision.retry_after_s
                                                  if isinstance(decision, Throttled) else None)
            else:
                admitted.append(block)
        return admitted

    def _release(self, reservation: Reservation | None, blocks: list[Reserved]) -> None:
        """Give `blocks`' pages back to the pool (a void epoch's pool takes nothing back)."""
        if reservation is not None:
            with tier_sized(len(blocks) > LOOP_PREPARE_BLOCKS):
                for block in paced(blocks):
                    self._pools.free(reservation.tier_id, reservation.epoch, block.runs)

    @contextmanager
    def paused(self):
        """No save is prepared meanwhile, and open reservations and remembered completions are
        dropped: the state they were made in is being read from SQL again."""
        with self._lock:
            self._forget_open()
            yield

    def forget_open(self) -> None:
        """Open reservations and remembered completions are dropped (this replica stopped leading)."""
        with self._lock:
            self._forget_open()

    def _forget_open(self) -> None:
        self.reservations.clear()
        self._completed_tokens.clear()

    # ---- complete, abort, renew, expire ---------------------------------------------------------

    async def complete_async(self, req) -> specs.StoreCompleted:
        def job(tx: Tx) -> tuple[int, str | None, int]:
            return self._complete(tx, req, self._clock())
        return self._completed(req, *await self._write_async(job, relaxed=True))  # a crash may lose it: a miss

    def _completed(self, req, committed: int, refused: str | None, total: int) -> specs.StoreCompleted:
        self._metrics.blocks_committed.inc(committed)
        if refused:
            raise KVStoreError("conflict", f"{refused}; nothing was committed", token=req.token)
        return specs.StoreCompleted(committed=committed, rolled_back=total - committed)

    def _complete(self, tx: Tx, req, now: float) -> tuple[int, str | None, int]:
        r = self.reservations.take(req.token)
        if r is None and req.token in self._completed_tokens:  # a duplicate, a retry whose answer was lost, late
            committed, refused, total = self._completed_tokens[req.token]
            said = "this one completed already" if refused is None else f"this one ended already ({refused})"
            raise KVStoreError("conflict", f"unknown, completed or rolled-back reservation token: {said}; "
                               "nothing changes", token=req.token, completed=refused is None,
                               committed=committed, rolled_back=total - committed)
        if r is None:  # also what a directory restart leaves: it rolled the reservation back
            raise KVStoreError("conflict", "unknown, completed or rolled-back reservation token (a directory "
                               "restart rolls back open reservations)", token=req.token)
        tx.on_rollback.append(lambda: self.reservations.untake(r))
        worker = self._index.workers.get(r.worker_id)
        refused = (EXPIRED if r.expires_at < now else
                   "the worker restarted since prepare_store (its memory, and so the written blocks, are gone)"
                   if worker is None or worker.epoch != r.epoch else None)
        live = refused is None
        reports = {b.hash: b for b in req.blocks}
        good, failed = [], []
        for block in r.blocks:
            report = reports.get(block.hash)
            ok = live and report is not None and report.ok and report.checksum is not None
            (good if ok else failed).append(block)
        if good:
            self._commit(tx, r, good, {b.hash: reports[b.hash].checksum.lower() for b in good}, now)
        outcome = len(good), refused, len(r.blocks)
        tx.after_commit.append(lambda: self._release(self.reservations.pop(r.token), failed))
        tx.after_commit.append(lambda: self._remember(req.token, outcome))
        return outcome

    def _remember(self, token: str, outcome: tuple) -> None:
        self._completed_tokens[token] = outcome
        if len(self._completed_tokens) > COMPLETED_KEPT:
            self._completed_tokens.popitem(last=False)

    def _commit(self, tx: Tx, r: Reservation, blocks: list[Reserved], checksums: dict[str, str], now: float) -> None:
        """The blocks, their checksums and their READY replicas, and the tier's used bytes."""
        chain = {b.hash: b.parent for b in blocks}
        outside = sorted({p for p in chain.values() if p is not None and p not in chain})
        depths = sql.depths(tx.session, self._index.ids(r.namespace_id, outside)) if outside else {}
        for block in blocks:  # parents come first in a chain
            depths[block.hash] = depths[block.parent] + 1 if block.parent in depths else 0
        block_ids = direct.insert_blocks(tx.session, r.namespace_id, [
            (b.hash, b.parent, depths[b.hash], b.nbytes, checksums[b.hash]) for b in blocks], now,
            there=self._index.ids(r.namespace_id, list(chain)))  # rows whose replicas cannot be read now
        replica_ids = direct.insert_replicas(tx.session, [
            (block_ids[b.hash], r.tier_id, r.epoch, r.token, b.runs, r.bytes_of([b]), now) for b in blocks])
        repo.add_used(tx.session, {r.tier_id: r.bytes_of(blocks)})
        tx.committed([(block_ids[b.hash], r.namespace_id, b.hash, b.parent, b.nbytes, checksums[b.hash],
                       replica_ids[block_ids[b.hash]], r.tier_id, r.epoch, b.runs) for b in blocks])

    def abort(self, token: str) -> int:
        def job(tx: Tx) -> int:
            r = self.reservations.take(token)
            if r is None:
                return 0
            tx.on_rollback.append(lambda: self.reservations.untake(r))
            tx.after_commit.append(lambda: self._release(self.reservations.pop(token), r.blocks))
            return len(r.blocks)
        return self._write(job)

    def renew(self, token: str) -> specs.Renewed:
        """Extend a reader's lease or a writer's reservation by its TTL from now (a long transfer)."""
        def job(tx: Tx) -> specs.Renewed | None:
            now = self._clock()
            leases = repo.leases_with_token(tx.session, token)
            if leases and all(lease.expires_at >= now for lease in leases):
                expires_at = now + self._settings.lease_ttl_s
                for lease in leases:
                    lease.expires_at = expires_at
                return specs.Renewed(token=token, expires_at=expires_at)
            r = self.reservations.get(token)
            if r is not None and r.expires_at >= now:
                before, r.expires_at = r.expires_at, now + self._settings.reservation_ttl_s
                tx.on_rollback.append(lambda: setattr(r, "expires_at", before))
                return specs.Renewed(token=token, expires_at=r.expires_at)
            return None
        renewed = self._write(job)
        if renewed is None:
            raise KVStoreError("conflict", "unknown, completed or expired token; it cannot be renewed", token=token)
        return renewed

    def expire(self, tx: Tx, now: float) -> int:
        """Reservations past their expiry roll back (in the reaper's job); returns how many."""
        gone = self.reservations.expired(now)
        for r in gone:  # a late completion learns that it expired
            tx.on_rollback.append(lambda r=r: self.reservations.add(r))
            tx.after_commit.append(lambda r=r: self._release(r, r.blocks))
            tx.after_commit.append(lambda r=r: self._remember(r.token, (0, EXPIRED, len(r.blocks))))
        return len(gone)


class PlacementTier(NamedTuple):
    """A memory tier new blocks may go to, as placement, admission and locations see it."""
    id: int
    worker_id: int
    kind: str
    capacity_bytes: int | None
    used_bytes: int  # its pages not in the page credit: committed replicas and reservations
    page_bytes: int
    base_addr: int
    device: int  # an HBM tier's CUDA device


def _placement(index: Index, pools: PagePools, hosts: frozenset[str] = frozenset(),
               need: int = 0) -> tuple[PlacementTier, WorkerView] | None:
    """The memory tier new blocks go to: the fastest kind any active worker has; of those, one on
    the engine's own host (`hosts`) whose page credit holds `need` bytes, else the one with the
    most page credit left."""
    for kind in tiers.MEMORY:
        candidates = [(t, index.workers[t.worker_id]) for t in index.tiers.values()
                      if t.kind == kind and index.workers[t.worker_id].state == "active"]
        if candidates:
            local = [(t, w) for t, w in candidates if _host(w.control_url) in hosts
                     and pools.free_bytes(t.id, w.epoch) >= need] if hosts else []
            tier, worker = max(local or candidates, key=lambda tw: pools.free_bytes(tw[0].id, tw[1].epoch))
            used = pools.granted_bytes(tier.id, worker.epoch) - pools.free_bytes(tier.id, worker.epoch)
            return PlacementTier(tier.id, tier.worker_id, kind, tier.capacity_bytes, used, tier.page_bytes,
                                 tier.base_addr, tier.device), worker
    return None


def _host(url: str) -> str | None:
    return urlsplit(url).hostname if url else None


_BUSY = object()  # a decision's locks were taken and the caller would not wait


class _NeedRoom(NamedTuple):
    tier_id: int
    worker_id: int
    nbytes: int


def _rejected(block_hash: str, reason: str, retry_after_s: float | None = None) -> dict:
    return {"hash": block_hash, "status": "rejected", "reason": reason, "retry_after_s": retry_after_s}


def _hints(said) -> Hints | None:
    """What a save says about its request (specs or wire RequestHints), as the policies take it."""
    return Hints(session=said.session_id, retain=said.retain, priority=said.priority) if said is not None else None
