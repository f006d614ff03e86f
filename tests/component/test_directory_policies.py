"""The directory runs the configured policy objects: admission at placement, eviction order that
survives a restart (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from kvstore.core import specs
from kvstore.directory.settings import DirectorySettings
from tests.stacks import directory_stack, make_settings, worker_endpoint
from tests.calls import chain, complete, hits, prepare, read


@pytest.fixture
def control():
    with worker_endpoint(32) as control:  # room for 16 blocks
        yield control


def test_a_doorkeeper_admits_a_block_on_its_second_save(database_url, control):
    with directory_stack(make_settings(database_url, admission="doorkeeper"), control) as s:
        first = prepare(s, chain(3)).blocks
        assert [(b.status, b.reason) for b in first] == [("rejected", "not_admitted")] + \
            [("rejected", "parent_rejected")] * 2
        assert s.free_pages() == 32  # nothing was reserved
        complete(s, prepare(s, chain(3)))  # seen before: admitted
        assert hits(s, chain(3)) == 3


def test_a_full_tier_of_pinned_blocks_throttles_writers(database_url, control):
    with directory_stack(make_settings(database_url, admission="backpressure"), control) as s:
        complete(s, prepare(s, chain(16)))
        load = s.client.prepare_load(specs.PrepareLoad(namespace_id=s.namespace_id, hashes=chain(16)))
        assert len(load.blocks) == 16  # every page of the tier pinned (the premise of what follows)
        decision = prepare(s, chain(1, start=900)).blocks[0]
        assert (decision.status, decision.reason, decision.retry_after_s) == ("rejected", "throttled", 1.0)
        s.client.complete_load(specs.CompleteLoad(token=load.token))
        assert prepare(s, chain(1, start=900)).blocks[0].status == "admitted"  # unpinned: room is made


def test_eviction_order_survives_a_directory_restart(database_url, control):
    # no reaper tick after the reads: the shut-down itself writes the access statistics
    settings = make_settings(database_url, heartbeat_timeout_s=600, reaper_interval_s=60)
    with directory_stack(settings, control) as s:
        old, recent = chain(8), chain(8, start=1000)  # 16 blocks fill the 32 pages
        complete(s, prepare(s, old))
        complete(s, prepare(s, recent))
        assert read(s, old) == 8  # the first chain is now the most recently used
    with directory_stack(settings, control, register=False) as s2:  # new process state, same database
        assert [b.status for b in prepare(s2, chain(2, start=5000)).blocks] == ["admitted"] * 2
        assert hits(s2, old) == 8
        assert hits(s2, recent) == 6  # the two deepest blocks of the colder chain went


def test_saves_commit_while_a_tiers_policy_is_built(database_url, control, monkeypatch):
    """The first eviction after a start builds the tier's policy from all its rows (19 s at 1M
    blocks): read as a job of the writer, it held every save's commit for as long."""
    from kvstore.directory.db import moves as sql

    reading, saved, during = threading.Event(), threading.Event(), []

    def slow(read):
        def rows(*args):
            reading.set()
            during.append(saved.wait(10))  # a save commits while the tier is read, or never
            return read(*args)
        return rows
    for name in ("policy_rows", "ready_replicas_of_tier"):  # whichever the build reads the tier with
        monkeypatch.setattr(sql, name, slow(getattr(sql, name)))
    # the order in the directory's own process (in a child of its own, its build holds nothing here)
    with directory_stack(make_settings(database_url, eviction_order="directory"), control) as s:
        complete(s, prepare(s, chain(4)))
        evicted = []
        evicting = threading.Thread(target=lambda: evicted.append(
            s.client.evict_tier(specs.EvictRequest(tier="dram", limit=2))))
        evicting.start()
        assert reading.wait(10)
        assert complete(s, prepare(s, chain(1, start=100))).committed == 1
        saved.set()
        evicting.join(30)
        assert during == [True] and evicted[0].dropped == 2
        assert hits(s, chain(1, start=100)) == 1


@pytest.mark.parametrize("where", ["child", "directory"])
def test_a_dry_run_asks_the_tiers_policy_without_reading_the_tier_or_changing_it(database_url, control,
                                                                                 monkeypatch, where):
    """A dry run read every replica of the tier into an object per row and synced a copy of the
    policy with them (seconds at a million blocks, lookups' p99 up to 8x meanwhile): it now asks
    the built policy what it would evict next."""
    from kvstore.directory.db import moves as sql

    def whole_tier(*args):
        raise AssertionError("a dry run read the whole tier")
    with directory_stack(make_settings(database_url, eviction_order=where), control) as s:
        cold, warm = chain(3), chain(3, start=100)
        complete(s, prepare(s, cold))
        complete(s, prepare(s, warm))
        assert read(s, cold) == 3  # now the most recently used
        s.service.flush()  # its reads reach SQL, which the policy is built from
        monkeypatch.setattr(sql, "ready_replicas_of_tier", whole_tier)
        monkeypatch.setattr(sql, "demotion_candidates", whole_tier)  # nor took SQL's order instead
        ask = dict(tier="dram", limit=2)
        for _ in range(2):
            dry = s.client.evict_tier(specs.EvictRequest(**ask, dry_run=True))
            assert (dry.replicas, dry.dropped) == (2, 2) and hits(s, warm) == 3  # said, changed nothing
        assert s.client.evict_tier(specs.EvictRequest(**ask)).dropped == 2
        assert hits(s, warm) == 1 and hits(s, cold) == 3  # what the dry run said: the warm chain's tail


def test_unknown_policies_and_tiers_are_refused_at_start():
    with pytest.raises(ValidationError, match="unknown eviction policy 'mru'"):
        DirectorySettings(eviction="mru")
    with pytest.raises(ValidationError, match="unknown tier kinds"):
        DirectorySettings(admission_by_tier={"tape": "always"})
    assert DirectorySettings(admission="doorkeeper").tier_admission() == {
        "hbm": "doorkeeper", "dram": "doorkeeper", "nvme": "always", "s3": "always"}  # capacity tiers keep demotions
    settings = DirectorySettings(admission_by_tier={"s3": "tinylfu"})
    assert settings.tier_admission() == {"hbm": "session", "dram": "session", "nvme": "session", "s3": "tinylfu"}
