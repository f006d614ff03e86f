"""Saves: prepare_store -> (the engine writes) -> complete_store | abort_store; renew.

    store.prepare(req, namespace) -> StorePrepared   # admission, placement, pages from the page pool
    store.complete(req) -> StoreCompleted            # WRITING -> READY, checksums recorded, in one job
    store.abort(token) -> n
    store.renew(token) -> Renewed                    # leases and reservations alike

A save makes no call to a worker: pages come from the page credit the workers
granted (`pools`). Only when that credit cannot hold the request does the save
first make room (demotion, outside every job) and then place.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import NamedTuple

from kvstore.core import specs, tiers
from kvstore.core.errors import KVStoreError
from kvstore.directory import repo_store as sql
from kvstore.directory import repository as repo
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.models.replica import WRITING
from kvstore.directory.policy import TierPolicies, block_key
from kvstore.directory.pools import PagePools
from kvstore.directory.reclaim import Reclaim
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.writer import Tx
from kvstore.policies import Admit, Throttled


class Store:
    def __init__(self, write, pools: PagePools, policies: TierPolicies, metrics: DirectoryMetrics,
                 settings: DirectorySettings, reclaim: Reclaim, make_room: Callable[[int, int, int], None],
                 clock: Callable[[], float]) -> None:
        self._write = write
        self._pools = pools
        self._policies = policies
        self._metrics = metrics
        self._settings = settings
        self._reclaim = reclaim
        self._make_room = make_room  # (tier id, worker id, bytes): demote until they fit
        self._clock = clock

    # ---- prepare ---------------------------------------------------------------------------

    def prepare(self, req) -> dict:
        """Namespace and sizes are checked by the caller. When the page credit cannot hold the new
        blocks, room is made first (outside every job), then the blocks are placed."""
        prepared = self._write(lambda tx: self._prepare(tx, req, self._clock(), room_first=True))
        if isinstance(prepared, _NeedRoom):
            self._make_room(prepared.tier_id, prepared.worker_id, prepared.nbytes)
            prepared = self._write(lambda tx: self._prepare(tx, req, self._clock(), room_first=False))
        self._metrics.count_store_decisions(prepared["blocks"])
        return prepared

    def _prepare(self, tx: Tx, req, now: float, room_first: bool):
        existing = sql.known_blocks(tx.session, req.namespace_id, [b.hash for b in req.blocks])
        decisions: dict[str, dict] = {}  # hash -> a StoreDecision as plain values
        wanted = []
        for block in req.blocks:
            known = existing.get(block.hash)
            if known is not None and known.ready:
                decisions[block.hash] = {"hash": block.hash, "status": "exists"}
            elif known is not None and known.writing:
                decisions[block.hash] = {"hash": block.hash, "status": "in_progress"}
            else:
                wanted.append(block)
        token = secrets.token_hex(16)
        expires_at = now + self._settings.reservation_ttl_s
        admitted = self._place(tx, req.namespace_id, wanted, existing, token, expires_at, now, decisions, room_first)
        if isinstance(admitted, _NeedRoom):
            return admitted
        return {"token": token if admitted else None, "expires_at": expires_at if admitted else None,
                "blocks": [decisions[b.hash] for b in req.blocks]}

    def _place(self, tx: Tx, namespace_id: str, wanted: list[specs.BlockToStore], existing: dict[str, sql.KnownBlock],
               token: str, expires_at: float, now: float, decisions: dict, room_first: bool) -> int | _NeedRoom:
        """Pages for `wanted` on the placement tier, from the page pool; fills `decisions`. With
        `room_first`, a request the pool cannot hold changes nothing and asks for room instead."""
        if not wanted:
            return 0
        choice = _placement(tx.session, self._pools)
        if choice is None:
            for block in wanted:
                decisions[block.hash] = _rejected(block.hash, "no_worker")
            return 0
        tier, worker = choice
        need = sum(b.nbytes for b in wanted)
        if room_first and need > self._pools.free_bytes(tier.id, worker.epoch):
            return _NeedRoom(tier.id, worker.id, need)
        wanted = self._admitted(tier, namespace_id, wanted, decisions)
        placed, rejected = [], set()
        allocated = self._pools.allocate_many(tier.id, worker.epoch, [b.nbytes for b in wanted])
        for block, runs in zip(wanted, allocated):
            if runs is not None and block.parent in rejected:  # a suffix without its prefix is useless
                self._pools.free(tier.id, worker.epoch, runs)
                runs = None
            if runs is None:
                rejected.add(block.hash)
                room = self._pools.free_bytes(tier.id, worker.epoch) >= block.nbytes
                decisions[block.hash] = _rejected(block.hash, "parent_rejected" if room else "no_space")
            else:
                placed.append((block, runs))
        tx.on_rollback.append(lambda: [self._pools.free(tier.id, worker.epoch, runs) for _, runs in placed])
        if not placed:
            return 0
        block_ids = _new_blocks(tx, namespace_id, [b for b, _ in placed], existing, now)
        replicas = []
        for block, runs in placed:
            replicas.append((block_ids[block.hash], tier.id, worker.epoch, token, runs,
                             sum(c for _, c in runs) * tier.page_bytes, expires_at, now))
            decisions[block.hash] = {"hash": block.hash, "status": "admitted",
                                     "location": location(worker, tier, runs, block.nbytes)}
        sql.insert_reservations(tx.session, replicas)
        sql.add_used(tx.session, tier.id, sum(r[5] for r in replicas))
        return len(placed)

    def _admitted(self, tier: sql.PlacementTier, namespace_id: str, wanted: list[specs.BlockToStore],
                  decisions: dict) -> list[specs.BlockToStore]:
        """The blocks the tier's admission lets in; the others (and their suffixes) are rejected."""
        admitted, rejected = [], set()
        for block in wanted:
            decision = self._policies.admit(tier, block_key(namespace_id, block.hash), block.nbytes)
            if block.parent in rejected or not isinstance(decision, Admit):
                reason = ("parent_rejected" if block.parent in rejected else
                          "throttled" if isinstance(decision, Throttled) else "not_admitted")
                rejected.add(block.hash)
                decisions[block.hash] = _rejected(block.hash, reason, decision.retry_after_s
                                                  if isinstance(decision, Throttled) else None)
            else:
                admitted.append(block)
        return admitted

    # ---- complete, abort, renew ---------------------------------------------------------------

    def complete(self, req) -> specs.StoreCompleted:
        committed, expired, total = self._write(lambda tx: self._complete(tx, req, self._clock()))
        self._metrics.blocks_committed.inc(committed)
        if expired:
            raise KVStoreError("conflict", "the reservation expired before completion; nothing was committed",
                               token=req.token)
        return specs.StoreCompleted(committed=committed, rolled_back=total - committed)

    def _complete(self, tx: Tx, req, now: float) -> tuple[int, bool, int]:
        reports = {b.hash: b for b in req.blocks}
        rows = sql.writing_rows(tx.session, req.token)
        if not rows:  # also what a worker restart leaves: its new epoch dropped the reservation
            raise KVStoreError("conflict", "unknown, completed or rolled-back reservation token (a worker "
                               "that restarted since prepare_store drops its reservations)", token=req.token)
        expired = any(r.expires_at is not None and r.expires_at < now for r in rows)
        failed, good, checksums = [], [], {}
        for row in rows:
            report = reports.get(row.hash)
            if expired or report is None or not report.ok or report.checksum is None or row.epoch != row.worker_epoch:
                failed.append(row.replica_id)
            else:
                good.append(row)
                checksums[row.block_id] = report.checksum.lower()
        sql.commit_replicas(tx.session, [r.replica_id for r in good], checksums)
        tx.committed([(r.block_id, r.namespace_id, r.hash, r.parent, r.nbytes, checksums[r.block_id], r.replica_id,
                       r.tier_id, r.epoch, r.pages) for r in good])
        self._reclaim.drop(tx, repo.replica_rows(tx.session, failed))
        return len(good), expired, len(rows)

    def abort(self, token: str) -> int:
        def job(tx: Tx) -> int:
            rows = repo.replicas_with_token(tx.session, token, WRITING)
            self._reclaim.drop(tx, [(r, t, w) for r, _, t, w in rows])
            return len(rows)
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
            writing = [r for r, _, _, _ in repo.replicas_with_token(tx.session, token, WRITING)]
            if writing and all(r.expires_at is not None and r.expires_at >= now for r in writing):
                expires_at = now + self._settings.reservation_ttl_s
                for replica in writing:
                    replica.expires_at = expires_at
                return specs.Renewed(token=token, expires_at=expires_at)
            return None
        renewed = self._write(job)
        if renewed is None:
            raise KVStoreError("conflict", "unknown, completed or expired token; it cannot be renewed", token=token)
        return renewed


def _new_blocks(tx: Tx, namespace_id: str, blocks: list[specs.BlockToStore], existing: dict[str, sql.KnownBlock],
                now: float) -> dict[str, int]:
    """Ids of `blocks`, inserting the ones the directory has not seen. Depth follows the parent chain."""
    ids = {h: b.id for h, b in existing.items()}
    depths = {h: b.depth for h, b in existing.items()}
    outside = {b.parent for b in blocks if b.parent and b.parent not in depths} - {b.hash for b in blocks}
    if outside:  # a chain saved in several calls (chunked prefill): continue from the stored parent
        depths.update({h: b.depth for h, b in sql.known_blocks(tx.session, namespace_id, sorted(outside)).items()})
    rows = []
    for block in blocks:
        if block.hash in ids:
            continue
        depths[block.hash] = depths[block.parent] + 1 if block.parent in depths else 0
        rows.append((namespace_id, block.hash, block.parent, depths[block.hash], block.nbytes, now))
    ids.update(sql.insert_blocks(tx.session, rows))
    return ids


def _placement(session, pools: PagePools) -> tuple[sql.PlacementTier, sql.PlacementWorker] | None:
    """The memory tier new blocks go to: the fastest kind any active worker has, and of those the one
    with the most page credit left."""
    for kind in tiers.MEMORY:
        candidates = sql.placement_tiers(session, kind)
        if candidates:
            return max(candidates, key=lambda tw: pools.free_bytes(tw[0].id, tw[1].epoch))
    return None


class _NeedRoom(NamedTuple):
    tier_id: int
    worker_id: int
    nbytes: int


def _rejected(block_hash: str, reason: str, retry_after_s: float | None = None) -> dict:
    return {"hash": block_hash, "status": "rejected", "reason": reason, "retry_after_s": retry_after_s}


def location(worker, tier, runs, nbytes: int) -> dict:
    """Where a replica's bytes are, for a connector (ReplicaLocation): absolute (address, length)
    runs in the worker's memory, or offsets in one object."""
    runs = [(0, nbytes)] if tier.kind == "s3" else specs.page_spans(tier.base_addr, tier.page_bytes, runs, nbytes)
    return {"worker": worker.name, "epoch": worker.epoch, "agent_name": worker.agent_name, "tier": tier.kind,
            "runs": runs}
