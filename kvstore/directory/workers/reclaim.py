"""Forgetting replicas, and giving their space back once the forgetting is committed.

    reclaim.drop(tx, rows)          # rows: (replica, tier, worker), ORM objects or db.repository's
                                    # plain rows; the replicas leave the map now
    reclaim.collect_deleting(tx)    # DELETING replicas no reader pins any more are dropped

A memory tier's pages go back to this directory's page pool; NVMe pages go
back to the worker (with the token they were allocated under: all the token's
pages for a move's destination whose pages the worker never reported), and an
S3 replica's object is deleted, both only after the commit and never inside it.
A dead worker, or one that restarted since, keeps nothing to give back.
"""

from __future__ import annotations

from kvstore.core import tiers
from kvstore.directory.db import repository as repo
from kvstore.directory.db.models import Replica, Tier, Worker
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.calls import WorkerCalls
from kvstore.directory.db.writer import Tx


class Reclaim:
    def __init__(self, calls: WorkerCalls, pools: PagePools) -> None:
        self._calls = calls
        self._pools = pools

    def drop(self, tx: Tx, rows: list[tuple[Replica | repo.ReplicaRef, Tier | repo.TierRef,
                                            Worker | repo.WorkerRef]], give_back: bool = True) -> None:
        """`give_back=False`: the replicas hold nothing to give back (a move's NVMe destination the
        worker took no page for)."""
        if not rows:
            return
        frees: dict[str, list[tuple]] = {}
        unknown: set[tuple[str, str]] = set()  # (worker, token) of NVMe destinations whose pages are not known
        used: dict[int, int] = {}
        for replica, tier, worker in rows:
            used[tier.id] = used.get(tier.id, 0) - replica.reserved_bytes
            if not give_back:
                continue
            if tier.kind in tiers.MEMORY:
                if replica.epoch == worker.epoch:
                    tx.after_commit.append(_pool_free(self._pools, tier.id, replica.epoch, replica.pages))
            elif tier.kind == "s3":
                block = repo.block(tx.session, replica.block_id)
                frees.setdefault(worker.control_url, []).append((replica.token, [],
                                                                 f"{block.namespace_id}/{block.hash}"))
            elif replica.epoch == worker.epoch and worker.state != "dead":
                if replica.pages:
                    frees.setdefault(worker.control_url, []).append((replica.token, replica.pages))
                elif (worker.control_url, replica.token) not in unknown:  # its move's answer was lost
                    unknown.add((worker.control_url, replica.token))
                    frees.setdefault(worker.control_url, []).append((replica.token, [], None, True))
        for url, items in frees.items():
            tx.after_commit.append(self._calls.free_later(url, items))
        repo.add_used(tx.session, used)
        repo.drop_replicas(tx.session, [r.id for r, _, _ in rows])
        repo.delete_orphan_blocks(tx.session, list({r.block_id for r, _, _ in rows}))

    def collect_deleting(self, tx: Tx) -> None:
        self.drop(tx, repo.unpinned_deleting(tx.session))


def _pool_free(pools: PagePools, tier_id: int, epoch: int, pages):
    return lambda: pools.free(tier_id, epoch, pages)
