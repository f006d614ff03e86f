"""The directory's per-tier policy holder against in-memory rows (no database)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.directory.tier_policies import TierPolicies, VictimRow
from kvstore.policies import Admit, Reject


@dataclass
class FakeTier:
    id: int = 1
    kind: str = "dram"
    capacity_bytes: int | None = 1000
    page_bytes: int = 100
    used_bytes: int = 0


def rows(*specs):
    """(key, last_access, pinned) -> VictimRow of 100 bytes; the row is the key."""
    return [VictimRow(key=k, parent=None, last_access=t, depth=0, hit_count=0, nbytes=100, pinned=p, row=k)
            for k, t, p in specs]


def policies(**admission):
    return TierPolicies({k: "lru" for k in ("hbm", "dram", "nvme", "s3")},
                        {k: admission.get(k, "always") for k in ("hbm", "dram", "nvme", "s3")})


def test_victims_follow_the_rows_least_recent_first_and_skip_pinned_ones():
    tier, p = FakeTier(), policies()
    table = rows(("a", 3.0, False), ("b", 1.0, True), ("c", 2.0, False))
    assert p.victims(tier, table, set(), to_free=150, limit=10) == ["c", "a"]  # b is pinned


def test_a_dry_run_changes_nothing_and_gone_rows_are_forgotten():
    tier, p = FakeTier(), policies()
    table = rows(("a", 1.0, False), ("b", 2.0, False))
    assert p.victims(tier, table, set(), to_free=100, limit=10, dry_run=True) == ["a"]
    assert p.victims(tier, table, set(), to_free=100, limit=10, dry_run=True) == ["a"]
    # "a" left the tier another way; a newer "c" arrived: the policy follows the rows
    assert p.victims(tier, rows(("b", 2.0, False), ("c", 3.0, False)), set(), 1000, 10) == ["b", "c"]


def test_hits_reorder_and_protected_keys_stay():
    tier, p = FakeTier(), policies()
    table = rows(("a", 1.0, False), ("b", 2.0, False), ("c", 3.0, False))
    p.victims(tier, table, set(), to_free=0, limit=10)  # sync only
    p.hit_many([([tier.id], "a", "ns/a")])
    assert p.victims(tier, table, {"b"}, to_free=200, limit=10) == ["c", "a"]


def test_admission_is_per_tier_kind():
    p = policies(nvme="doorkeeper")
    assert p.admit(FakeTier(), "k", 100) == Admit()
    nvme = FakeTier(id=2, kind="nvme")
    assert isinstance(p.admit(nvme, "k", 100), Reject) and p.admit(nvme, "k", 100) == Admit()


def test_a_build_replays_what_changed_while_it_read_and_a_second_caller_waits_for_it():
    p = policies()
    tier = FakeTier()
    reads = []

    def read_rows(fill):  # the tier as SQL had it, in two chunks; commits land while it is read
        reads.append(1)
        fill([(1, None, 0, None, None), (2, None, 0, None, None)])  # oldest first
        p.changed([(4, None, "ns", "new", [tier.id], []), (2, None, "ns", "b", [], [tier.id])])
        fill([(3, 1, 0, None, None)])

    p.build(tier, read_rows)
    p.build(tier, read_rows)  # built: nothing read again
    assert reads == [1] and p.built(tier)
    assert p.evict(tier, 10, keep=set()) == [1, 3, 4]  # b (2) went meanwhile; new (4) came last
    p.changed([(5, None, "ns", "later", [tier.id], [])])  # once built, changes go straight in
    assert p.evict(tier, 10, keep=set()) == [5]
