"""Page credit: the pages of workers' memory tiers that this directory may place blocks in.

    pools.add(tier_id, epoch, page_bytes, runs)      # a worker granted these pages
    pools.allocate(tier_id, epoch, nbytes) -> runs | None
    pools.free(tier_id, epoch, runs)                 # a replica's pages, after the commit that forgot it
    pools.free_bytes(tier_id, epoch) -> int
    pools.rebuild(session)                           # at start: grants minus the pages replicas hold

A worker grants pages in bulk (`POST /v1/grant`), so a save needs no call to
the worker: the directory allocates from its pool when it prepares the save and
gives pages back to the pool when a replica goes. Grants are recorded in SQL
with the worker's epoch; a new epoch (the worker restarted, its memory is
empty) voids them. Only the writer thread adds and drops pools; each pool
locks its own allocations and frees, which saves make from the event loop.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.core import specs
from kvstore.core.pages import PageAllocator
from kvstore.directory.db import repository as repo

if TYPE_CHECKING:
    from kvstore.directory.db.engine import Session

log = logging.getLogger(__name__)
OWNER = "directory"  # the pool's own tag for the pages it hands out


class PagePools:
    def __init__(self) -> None:
        self._pools: dict[int, tuple[int, PageAllocator]] = {}  # tier id -> (epoch, pool)

    def _pool(self, tier_id: int, epoch: int) -> PageAllocator | None:
        found = self._pools.get(tier_id)
        return found[1] if found is not None and found[0] == epoch else None

    def add(self, tier_id: int, epoch: int, page_bytes: int, runs: list[specs.PageRun]) -> None:
        found = self._pools.get(tier_id)
        if found is None or found[0] != epoch:  # first grant of this epoch: the old pages are void
            found = (epoch, PageAllocator(0, page_bytes, owners=False))  # one tag: no record per block
            self._pools[tier_id] = found
        found[1].add_free(runs)

    def allocate(self, tier_id: int, epoch: int, nbytes: int) -> list[tuple[int, int]] | None:
        """(first, count) page runs, or None when the credit cannot hold `nbytes`."""
        pool = self._pool(tier_id, epoch)
        return pool.allocate_pairs(OWNER, nbytes) if pool is not None else None

    def allocate_many(self, tier_id: int, epoch: int, sizes: list[int]) -> list[list[tuple[int, int]] | None]:
        """`allocate` for each size in turn, from one contiguous stretch when the pool has one."""
        pool = self._pool(tier_id, epoch)
        return pool.allocate_many(OWNER, sizes) if pool is not None else [None] * len(sizes)

    def free(self, tier_id: int, epoch: int, runs) -> None:
        pool = self._pool(tier_id, epoch)
        if pool is not None and runs:
            assert pool.free(OWNER, runs), "pages freed twice or never allocated"

    def free_bytes(self, tier_id: int, epoch: int) -> int:
        pool = self._pool(tier_id, epoch)
        return pool.free_pages * pool.page_bytes if pool is not None else 0

    def granted_bytes(self, tier_id: int, epoch: int) -> int:
        pool = self._pool(tier_id, epoch)
        return pool.num_pages * pool.page_bytes if pool is not None else 0

    def forget(self, tier_id: int) -> None:
        self._pools.pop(tier_id, None)

    def clear(self) -> None:
        """No page credit at all (a replica that does not lead hands out no pages)."""
        self._pools.clear()

    def rebuild(self, session: Session, tiers: dict, workers: dict) -> None:
        """Grants of each tier's current epoch, less the pages its replicas of that epoch hold."""
        self.clear()
        for grant in repo.grants(session):
            tier = tiers.get(grant.tier_id)
            if tier is not None and workers[tier.worker_id].epoch == grant.epoch:
                self.add(grant.tier_id, grant.epoch, tier.page_bytes, [_run(r) for r in grant.runs])
        for tier_id, (epoch, pool) in self._pools.items():
            outside, overlapping = pool.reserve_all(run for pages in repo.pages_in_use(session, tier_id, epoch)
                                                    for run in pages)
            if outside or overlapping:
                log.warning("tier %d: its replicas name %d pages outside the granted pages and %d page runs that "
                            "overlap another's", tier_id, outside, overlapping)


def _run(run) -> specs.PageRun:
    return run if isinstance(run, specs.PageRun) else specs.PageRun(first=run[0], count=run[1])
