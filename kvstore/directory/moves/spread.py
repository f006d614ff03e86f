"""Blocks between workers: a namespace's replication factor, and drains onto other workers.

    spread.replicate() -> n         # the reaper: blocks of namespaces with `replicas` > 1 that fewer
                                    # active workers hold get a copy in another worker's DRAM
    spread.drain(worker_id) -> n    # a draining worker's DRAM blocks go to other workers' DRAM (those
                                    # another worker holds already are dropped here); what finds no
                                    # room elsewhere goes down a tier as before (movement.drain)

Copies are worker to worker (`moves.copy(..., dest_worker_id=...)`: a UCX WRITE by the source worker,
checked by the destination) into pages of the directory's credit on the destination. A destination
is an active worker that does not hold the block yet and has the most free credit; a copy never
makes room by demoting anything there. A source is a READY DRAM replica (a block that lives only on
NVMe gets its copy once a read has promoted it).
"""

from __future__ import annotations

import logging

from kvstore.directory.db import moves as sql
from kvstore.directory.db import repository as repo
from kvstore.directory.db.models.replica import DELETING, READY, VISIBLE
from kvstore.directory.moves.move import Moves
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.reclaim import Reclaim
from kvstore.directory.db.writer import Tx, Write

log = logging.getLogger(__name__)
MAX_COPIES_PER_ROUND = 256
HOLDING = ("hbm", "dram", "nvme")  # tiers whose copies count towards a namespace's replicas


class Spread:
    def __init__(self, write: Write, moves: Moves, reclaim: Reclaim, pools: PagePools) -> None:
        self._write = write
        self._moves = moves
        self._reclaim = reclaim
        self._pools = pools

    def replicate(self, limit: int = MAX_COPIES_PER_ROUND) -> int:
        def plan(tx: Tx) -> dict[tuple[int, int, int], list[int]]:
            wanted = sql.replicated_namespaces(tx.session)  # a small table: most ticks stop here
            blocks: list[int] = []
            for namespace_id, n in wanted.items():
                blocks += sql.under_replicated(tx.session, namespace_id, n, limit - len(blocks))
                if len(blocks) >= limit:
                    break
            return self._plan(tx, blocks, drop_held=False)[0] if blocks else {}
        copied = self._copy(self._write(plan), source_stays=True)
        if copied:
            log.info("replication: %d blocks copied to another worker", copied)
        return copied

    def drain(self, worker_id: int) -> int:
        """One round of a draining worker's DRAM onto other workers; returns the blocks that left."""
        def plan(tx: Tx) -> tuple[dict, int]:
            own = repo.tiers_of(tx.session, worker_id).get("dram")
            if own is None:
                return {}, 0
            rows = sql.ready_replicas_of_tier(tx.session, own.id)[:MAX_COPIES_PER_ROUND]
            return self._plan(tx, [b.id for _, b, _, _ in rows], drop_held=True, only_from=own.id)
        copies, dropped = self._write(plan)
        moved = self._copy(copies, source_stays=False) + dropped
        if moved:
            log.info("drain: %d blocks of worker %d moved to other workers (%d held there already)",
                     moved, worker_id, dropped)
        return moved

    def _plan(self, tx: Tx, block_ids: list[int], drop_held: bool,
              only_from: int | None = None) -> tuple[dict[tuple[int, int, int], list[int]], int]:
        """{(source worker, source tier, destination worker): [source replica ids]}, and with
        `drop_held` the number of source replicas dropped because another active worker holds the block."""
        holders: dict[int, list] = {}
        for replica, tier, worker in repo.replicas_of(tx.session, block_ids):
            holders.setdefault(replica.block_id, []).append((replica, tier, worker))
        credit = {w.id: self._pools.free_bytes(t.id, w.epoch) for t, w in repo.active_tiers(tx.session, "dram")
                  if not self._moves.backing_off(t.id)}
        copies: dict[tuple[int, int, int], list[int]] = {}
        dropped = 0
        for block_id in block_ids:
            rows = holders.get(block_id, [])
            have = {w.id for r, t, w in rows if r.state in VISIBLE and t.kind in HOLDING and w.state == "active"}
            source = next(((r, t, w) for r, t, w in rows if r.state == READY and t.kind == "dram" and
                           w.state != "dead" and (only_from is None or t.id == only_from)), None)
            if source is None:
                continue
            replica, tier, worker = source
            if drop_held and have - {worker.id}:
                replica.state = DELETING  # another worker has it: nothing to copy
                dropped += 1
                continue
            targets = [w for w, free in credit.items() if w not in have and w != worker.id
                       and free >= replica.reserved_bytes]
            if not targets:
                continue
            dest = max(targets, key=credit.get)
            credit[dest] -= replica.reserved_bytes
            copies.setdefault((worker.id, tier.id, dest), []).append(replica.id)
        if dropped:
            repo.flush(tx.session)
            self._reclaim.collect_deleting(tx)
        return copies, dropped

    def _copy(self, copies: dict[tuple[int, int, int], list[int]], source_stays: bool) -> int:
        return sum(len(self._moves.copy(w, t, "dram", ids, source_stays=source_stays, dest_worker_id=d))
                   for (w, t, d), ids in copies.items())
