"""The lookup index's visibility rules and the directory's page credit, without a database."""

from __future__ import annotations

import gc
import itertools

from kvstore.core import heap
from kvstore.core.tiers import tier_runs
from kvstore.directory.db.index import Index
from kvstore.directory.db.views import TierView, WorkerView
from kvstore.directory.workers.credit import PagePools
from kvstore.core import specs


def index_with(worker_state: str = "active", worker_epoch: int = 1) -> Index:
    index = Index()
    index.set_topology({1: WorkerView(1, "w", "w-agent", worker_epoch, worker_state)},
                       {10: TierView(10, 1, "dram", 128, 1 << 20), 11: TierView(11, 1, "nvme", 128, 0),
                        12: TierView(12, 1, "s3", 1, 0)})
    rows = []
    for i, (tier_id, epoch) in enumerate([(10, 1), (11, 1), (12, 1)]):  # block i lives on one tier
        rows.append((i, "ns", f"h{i}", None, 256, "0123456789abcdef", 100 + i, tier_id, epoch, [[2 * i, 2]]))
    index._apply(rows, set(), None)
    return index


def test_a_lookup_stops_at_the_first_miss_and_takes_the_best_replica():
    index = index_with()
    hits = index.lookup("ns", ["h0", "h1", "h2", "nope", "h0"])
    assert [h.hash for h in hits] == ["h0", "h1", "h2"]
    assert [h.tier.kind for h in hits] == ["dram", "nvme", "s3"]
    index._apply([(0, "ns", "h0", None, 256, "0123456789abcdef", 200, 11, 1, [[9, 2]]),
                  (0, "ns", "h0", None, 256, "0123456789abcdef", 100, 10, 1, [[0, 2]])], {0}, None)
    assert index.lookup("ns", ["h0"])[0].tier.kind == "dram"  # dram before nvme, whatever the row order
    assert index._by_id[0][5] == ((100, 10, 1, 0, 2), (200, 11, 1, 9, 2))  # two replicas: a tuple of them
    index.add([(0, "ns", "h0", None, 256, "0123456789abcdef", 300, 12, 1, [])])  # a third, merged in
    assert [r[0] for r in index._by_id[0][5]] == [100, 200, 300]
    index.record([index._by_id[0]])  # a load read it
    drained = index.drain_accesses()[1][0]
    assert [r.id for r in drained.replicas] == [100, 200, 300]
    assert index.best(drained)[0] == (100, 10, 1, (0, 2))  # a drained entry's best replica, pages as kept
    index._apply([(0, "ns", "h0", None, 256, "0123456789abcdef", 300, 12, 1, [])], {0}, None)  # two dropped
    assert index._by_id[0][5] == (300, 12, 1) and index.lookup("ns", ["h0"])[0].replica_id == 300


def test_memory_replicas_of_an_old_epoch_or_a_dead_worker_are_not_readable():
    assert [h.tier.kind for h in index_with(worker_epoch=2).lookup("ns", ["h0"])] == []  # a restart
    dead = index_with(worker_state="dead")
    assert dead.lookup("ns", ["h0"]) == [] and dead.lookup("ns", ["h1"]) == []
    assert [h.tier.kind for h in dead.lookup("ns", ["h2"])] == ["s3"]  # objects outlive the worker


def test_a_reload_without_rows_forgets_the_block_and_tells_the_policies():
    index = index_with()
    changes = []
    index._apply([], {1}, changes)
    assert index.lookup("ns", ["h1"]) == [] and index.num_blocks == 2
    assert changes == [(1, None, "ns", "h1", (), [11])]  # block id, parent id, namespace, hash, added, removed


def test_an_update_tells_the_policies_once_and_its_entries_leave_the_garbage_collectors_sight():
    told = []
    index = index_with()
    index.on_change = told.append
    sizes = [int("4096"), int("4096")]  # equal, two objects (as two rows read from SQL)
    index.add([(7, "ns", "h7", "h2", sizes[0], "0123456789abcdef", 107, 10, 1, [[20, 2]]),
               (8, "ns", "h8", "h7", sizes[1], "0123456789abcdef", 108, 10, 1, [[22, 2]])])
    assert told == [[(7, 2, "ns", "h7", (10,), ()), (8, 7, "ns", "h8", (10,), ())]]  # parents by their ids
    assert index._by_id[8][5] == (108, 10, 1, 22, 2)  # one replica, its pages in its tuple, not in a tuple of one
    assert index._by_id[7][3] is index._by_id[8][3]  # one size object for the blocks of that size
    hits = index.lookup("ns", ["h7", "h8"])
    assert [(h.hash, h.block_id, h.runs()) for h in hits] == [("h7", 7, [(20, 2)]), ("h8", 8, [(22, 2)])]
    for _ in range(4):  # a collection untracks a plain tuple of untracked values: one level each time
        gc.collect()
    assert not any(gc.is_tracked(index._by_id[i]) for i in (7, 8))  # no full collection walks them again


def test_a_frozen_dict_stays_out_of_every_collection_however_it_grows():
    by_hash = heap.frozen_dict()
    by_hash.update((str(i), (i, [i])) for i in range(1000))  # tracked values: the dict is tracked
    gc.collect()
    assert gc.is_tracked(by_hash) and not any(o is by_hash for o in gc.get_objects())  # not walked: frozen
    assert len(by_hash) == 1000 and None not in by_hash


def test_reads_are_counted_deepest_first_until_drained_and_lookups_count_nothing():
    index = index_with()
    index.lookup("ns", ["h0", "h1"])
    index.count("ns", ["h0", "h1"])
    assert index.drain_accesses()[0] == {}
    index.record([h.entry for h in index.lookup("ns", ["h0", "h1"])])
    index.record([h.entry for h in index.lookup("ns", ["h0"])])
    counts, entries = index.drain_accesses()
    assert counts == {0: 2, 1: 1} and list(counts) == [1, 0]
    assert [e.hash for e in entries.values()] == ["h1", "h0"]
    assert index.drain_accesses()[0] == {}


def test_a_count_agrees_with_a_lookup_on_hits_and_tiers():
    for state, epoch in [("active", 1), ("active", 2), ("dead", 1)]:
        index = index_with(worker_state=state, worker_epoch=epoch)
        for hashes in (["h0", "h1", "h2"], ["h2", "h0"], ["h1", "nope", "h2"], []):
            hits = index.lookup("ns", hashes)
            kinds: dict[str, int] = {}
            for h in hits:
                kinds[h.tier.kind] = kinds.get(h.tier.kind, 0) + 1
            runs = [(k, len(list(g))) for k, g in itertools.groupby(h.tier.kind for h in hits)]
            assert index.count("ns", hashes) == (len(hits), kinds, runs), (state, epoch, hashes)
    assert index_with().count("other", ["h0"]) == (0, {}, [])
    assert index_with().count("ns", ["h0", "h1", "h2"])[2] == [("dram", 1), ("nvme", 1), ("s3", 1)]


def test_page_credit_places_many_blocks_in_one_cut_and_takes_them_back():
    pools = PagePools()
    pools.add(7, 1, 128, [specs.PageRun(first=0, count=8), specs.PageRun(first=20, count=4)])
    assert pools.free_bytes(7, 1) == 12 * 128
    runs = pools.allocate_many(7, 1, [256, 256, 256])
    assert runs == [[(0, 2)], [(2, 2)], [(4, 2)]]
    assert pools.allocate_many(7, 1, [4 * 128, 4 * 128]) == [[(20, 4)], None]  # 2 + 4 pages left, scattered
    pools.free(7, 1, runs[1])
    assert pools.free_bytes(7, 1) == 4 * 128
    assert pools.allocate(7, 2, 128) is None  # another epoch: that credit is void
    pools.add(7, 2, 128, [specs.PageRun(first=0, count=1)])
    assert pools.free_bytes(7, 1) == 0 and pools.free_bytes(7, 2) == 128


def test_a_block_id_that_sqlite_gives_again_replaces_the_deleted_block_in_the_index():
    index = index_with()
    reused = (0, "ns", "new", None, 256, "0123456789abcdef", 300, 10, 1, [[40, 2]])  # block 0 was h0
    index._apply([reused], set(), None)
    assert index.lookup("ns", ["h0"]) == [] and [h.hash for h in index.lookup("ns", ["new"])] == ["new"]
    index._apply([], {0}, None)
    assert index.lookup("ns", ["new"]) == [] and index.num_blocks == 2


def test_a_block_saved_again_under_a_new_id_leaves_no_entry_of_its_old_id():
    index = index_with()
    index._apply([(7, "ns", "h0", None, 256, "0123456789abcdef", 301, 10, 1, [[50, 2]])], set(), None)
    assert index.num_blocks == 3 and index.lookup("ns", ["h0"])[0].block_id == 7
    index._apply([], {0}, None)  # the old id's removal does not take the new entry
    assert index.lookup("ns", ["h0"])[0].block_id == 7


def test_tier_runs_merge_neighbouring_tiers_of_one_kind():
    homes = [(10, 1), (10, 1), (13, 1), (11, None), (10, 1)]  # tiers 10 and 13: DRAM of two workers
    kinds = {10: "dram", 13: "dram", 11: "nvme"}
    assert tier_runs(homes, lambda home: kinds[home[0]]) == [("dram", 3), ("nvme", 1), ("dram", 1)]
    assert tier_runs([]) == [] and tier_runs(["s3", "s3"]) == [("s3", 2)]
