"""A call's SQL does work in proportion to the blocks it names, not to the size of the tables.

SQLite plans without statistics: it takes an equality on any indexed column for about ten rows, so
a statement that named replicas by id and also asked for their state walked the state index, every
READY replica, on each load's pin, each eviction's victims and each read-back of the lookup index.
The work is counted in SQLite's virtual-machine steps (its progress handler), which are exact where
timings are not. SQLite only: PostgreSQL plans from the statistics it keeps.
"""

from __future__ import annotations

import re
from collections import Counter
from contextlib import contextmanager

from sqlalchemy import event
from sqlalchemy.engine import Engine

from kvstore.core import moving, specs
from tests.calls import chain, complete, prepare, read
from tests.stacks import PAGE, directory_stack, dram_tier, make_settings, registration, worker_endpoint

STEPS = 50  # virtual-machine steps per count
PAGES = 20_000  # per tier: room for every block saved here
LITERALS = re.compile(r"'[^']*'|\b\d+(\.\d+)?\b")


class SqlWork:
    """VM steps of every statement run on the directory's SQLite connections while `counting`."""

    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()
        self.counting = False

    def connected(self, dbapi, _record) -> None:
        statement = [""]

        def traced(sql: str) -> None:
            statement[0] = LITERALS.sub("?", " ".join(sql.split()))

        def step() -> int:
            if self.counting:
                self.steps[statement[0]] += STEPS
            return 0  # go on
        dbapi.set_trace_callback(traced)
        dbapi.set_progress_handler(step, STEPS)

    @contextmanager
    def counted(self):
        self.steps = Counter()
        self.counting = True
        try:
            yield self.steps
        finally:
            self.counting = False


def _moved(req: moving.MoveRequest) -> moving.MoveResult:
    n = len(req.items)
    return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)


def _calls(s, first: int) -> None:
    """Saves, demotions to NVMe (victims, their kinds, pinned ones), loads that promote them back
    (pins, releases) and the index's read-back of every block a move touched."""
    for i in range(3):
        hashes = chain(16, start=first + 1000 * i)
        complete(s, prepare(s, hashes))
        assert s.client.evict_tier(specs.EvictRequest(tier="dram", limit=16)).demoted == 16
        assert read(s, hashes) == 16


def _fill(s, blocks: int, first: int) -> None:
    for start in range(first, first + 4 * blocks, 4 * 128):
        complete(s, prepare(s, chain(128, start=start)))


def test_a_calls_sql_work_does_not_grow_with_the_tables(tmp_path):
    work = SqlWork()
    event.listen(Engine, "connect", work.connected)
    try:
        with worker_endpoint(PAGES, nvme_pages=PAGES, mover=_moved) as control, \
                directory_stack(make_settings(f"sqlite:///{tmp_path / 'directory.db'}", reaper_interval_s=60),
                                control, register=False) as s:
            s.client.register_worker(registration("w0", control.url, backends=["UCX", "POSIX"], tiers=[
                dram_tier(PAGES), specs.TierSpec(kind="nvme", capacity_bytes=PAGES * PAGE, page_bytes=PAGE)]))
            _fill(s, 256, first=1_000_000)
            with work.counted() as small:
                _calls(s, first=10_000_000)
            _fill(s, 4096, first=2_000_000)  # 17 times as many rows
            with work.counted() as large:
                _calls(s, first=20_000_000)
    finally:
        event.remove(Engine, "connect", work.connected)
    grown = {sql: (small[sql], n) for sql, n in large.most_common(5)}
    assert sum(large.values()) < 1.5 * sum(small.values()), grown
