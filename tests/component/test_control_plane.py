"""The control plane's hot path: lookups from memory, the writer's group commit, page credit, and the
defects they replaced (each of these failed before its fix), over HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from kvstore.core import moving, specs
from kvstore.core.errors import KVStoreError
from kvstore.directory.db.index import Index
from kvstore.directory.db.models import Replica, Tier
from tests.stacks import PAGE, directory_stack, dram_tier, make_settings, registration, two_tier_stack, worker_endpoint
from tests.calls import BLOCK, chain, complete, hits, prepare
from tests.helpers import wait_until


def index_matches_sql(service) -> None:
    """The lookup index equals one rebuilt from SQL: no block, replica or location differs."""
    fresh = Index()
    with service.sessions() as session:
        fresh.rebuild(session)
    assert fresh.contents() == service.index.contents()


def one_worker(database_url: str, pages: int = 32, **settings):
    """The directory over HTTP with one DRAM-only worker endpoint of `pages` pages."""
    return directory_stack(make_settings(database_url, **settings), pages=pages)


def test_a_lookup_takes_no_job_and_writes_nothing(database_url):
    with one_worker(database_url, reaper_interval_s=60) as s:  # no access-statistics flush meanwhile
        complete(s, prepare(s, chain(4)))
        jobs = s.service.writer.jobs
        for _ in range(50):
            assert hits(s, chain(4)) == 4
        assert s.service.writer.jobs == jobs  # answered from the index alone
        assert s.service.loads.flush_accesses() == 0  # a lookup is not an access
        load = s.client.prepare_load(specs.PrepareLoad(namespace_id=s.namespace_id, hashes=chain(4)))
        assert s.service.loads.flush_accesses() == 4  # a load is: its blocks reach SQL later, in one batch
        s.client.complete_load(specs.CompleteLoad(token=load.token, blocks=[
            specs.BlockRead(hash=b.hash, ok=True) for b in load.blocks]))


def test_duplicate_hashes_in_one_prepare_store_are_a_400_and_reserve_nothing(stack):
    hashes = chain(2)
    with pytest.raises(KVStoreError) as info:
        prepare(stack, hashes + hashes[:1])
    assert info.value.kind == "invalid" and "more than once" in info.value.message
    assert stack.free_pages() == 32 and stack.client.stats().reservations == 0


def test_saving_a_cached_prefix_again_evicts_nothing(stack):
    full = chain(16)  # 16 blocks fill the 32-page tier; there is no tier below
    complete(stack, prepare(stack, full))
    again = prepare(stack, full)
    assert {b.status for b in again.blocks} == {"exists"}
    assert hits(stack, full) == 16  # before: room was made for all 16 "new" blocks, dropping them


def test_bad_sizes_on_a_full_tier_are_a_400_before_any_room_is_made(stack):
    full = chain(16)
    complete(stack, prepare(stack, full))
    with pytest.raises(KVStoreError) as info:
        stack.client.prepare_store(specs.PrepareStore(namespace_id=stack.namespace_id, blocks=[
            specs.BlockToStore(hash=h, nbytes=BLOCK + 1) for h in chain(4, start=500)]))
    assert info.value.kind == "invalid"
    assert hits(stack, full) == 16


def test_a_save_that_needs_more_room_than_one_round_frees_gets_it(database_url):
    """A full DRAM-only tier and a request for most of it: room is made for the whole request."""
    with one_worker(database_url, pages=2 * 600) as s:  # 600 blocks
        for start in range(0, 600, 100):
            complete(s, prepare(s, chain(100, start=start * 4)))
        big = prepare(s, chain(500, start=100_000))  # more than one round of 256 moves
        assert [b.status for b in big.blocks] == ["admitted"] * 500
        assert complete(s, big).committed == 500


def test_seventy_thousand_blocks_in_one_call_pass_every_statement(database_url):
    """PostgreSQL takes at most 65,535 parameters a statement: every IN list is chunked."""
    n = 70_000
    with one_worker(database_url, pages=2 * n, reaper_interval_s=60) as s:
        client = s.client
        hashes = [f"{i:032x}" for i in range(n)]
        assert complete(s, prepare(s, hashes)).committed == n
        load = client.prepare_load(specs.PrepareLoad(namespace_id=s.namespace_id, hashes=hashes))
        assert len(load.blocks) == n
        assert s.service.loads.flush_accesses() == n
        assert client.complete_load(specs.CompleteLoad(token=load.token)).released == n
        assert client.evict(s.namespace_id) == n
        assert hits(s, hashes) == 0 and s.free_pages() == 2 * n


def test_concurrent_engines_never_see_a_500_and_the_index_stays_true(stack):
    """Six engines save, look up, load and abort overlapping chains at once."""
    errors: list[BaseException] = []
    shared = chain(4, start=10_000)

    def engine(k: int) -> None:
        try:
            for round_ in range(8):
                own = chain(2, start=1000 * k + 10 * round_)
                for hashes in (shared, own):
                    prepared = prepare(stack, hashes)
                    if prepared.token and round_ % 3 == 2:
                        stack.client.abort_store(prepared.token)
                    elif prepared.token:
                        complete(stack, prepared)
                    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id,
                                                                       hashes=hashes))
                    if load.token:
                        stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=[
                            specs.BlockRead(hash=b.hash, ok=k != 5 or round_ != 4) for b in load.blocks]))
                    hits(stack, hashes)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    stats = stack.client.stats()
    assert (stats.pins, stats.leases_active, stats.reservations) == (0, 0, 0)
    assert stats.committed_jobs >= stats.commit_groups
    index_matches_sql(stack.service)
    stack.free_pages()  # page credit and used_bytes agree


def test_a_save_of_blocks_whose_completion_is_committing_does_not_write_them_again(quiet):
    """complete_store has committed but the index has not yet heard of it: a save of the same blocks
    then finds them being written, and once the index has them, finds that they exist."""
    s = quiet
    first = prepare(s, chain(2))
    writer = s.service.writer
    committed, go_on = threading.Event(), threading.Event()
    follow = writer.on_commit

    def slow_follow(*args):
        committed.set()
        go_on.wait(10)
        follow(*args)
    writer.on_commit = slow_follow
    answers: dict[str, object] = {}
    completer = threading.Thread(target=lambda: answers.update(done=complete(s, first)))
    completer.start()
    try:
        assert committed.wait(10)
        assert [b.status for b in prepare(s, chain(2)).blocks] == ["in_progress"] * 2
    finally:
        writer.on_commit = follow
        go_on.set()
        completer.join(10)
    assert answers["done"].committed == 2
    assert [b.status for b in prepare(s, chain(2)).blocks] == ["exists"] * 2
    assert s.client.stats().replicas_by_tier == {"dram": 2}
    index_matches_sql(s.service)


@pytest.fixture
def quiet(database_url):
    """A stack whose reaper stays asleep: the writer runs only what the test sends."""
    with one_worker(database_url, reaper_interval_s=60) as s:
        yield s


def test_waiting_writers_share_one_commit(quiet):
    writer = quiet.service.writer
    release, started = threading.Event(), threading.Event()
    holder = threading.Thread(target=writer.run, args=(lambda tx: (started.set(), release.wait(10)),))
    holder.start()
    started.wait(10)
    groups, jobs = writer.groups, writer.jobs
    savers = [threading.Thread(target=lambda k=k: complete(quiet, prepare(quiet, chain(1, start=4 * k))))
              for k in range(6)]
    for t in savers:
        t.start()
    wait_until(lambda: writer.queued >= 6, 10, "six prepares queued")
    release.set()
    for t in [holder, *savers]:
        t.join()
    # the six prepares waiting together ran as one group: one commit, not six
    assert (writer.jobs - jobs) - (writer.groups - groups) >= 5
    assert all(hits(quiet, chain(1, start=4 * k)) == 1 for k in range(6))


def test_a_failing_job_is_rolled_back_alone(quiet):
    stack = quiet
    from kvstore.directory.db.models import NamespaceRow

    def good(tx):
        tx.session.add(NamespaceRow(id="good0000", spec={}, created_at=0.0))

    def bad(tx):
        tx.session.add(NamespaceRow(id="bad00000", spec={}, created_at=0.0))
        tx.session.flush()
        raise KVStoreError("invalid", "this job fails after writing")

    release, started = threading.Event(), threading.Event()
    holder = threading.Thread(target=stack.service.writer.run,
                              args=(lambda tx: (started.set(), release.wait(10)),))
    holder.start()
    started.wait(10)
    outcome = {}
    runners = [threading.Thread(target=lambda: outcome.setdefault("bad", _try(stack.service.writer.run, bad))),
               threading.Thread(target=lambda: outcome.setdefault("good", _try(stack.service.writer.run, good)))]
    for t in runners:
        t.start()
    wait_until(lambda: stack.service.writer.queued >= 2, 10, "both queued")
    release.set()
    for t in [holder, *runners]:
        t.join()
    assert isinstance(outcome["bad"], KVStoreError) and outcome["good"] is None
    groups = stack.service.writer.groups
    assert isinstance(_try(stack.service.writer.run, bad), KVStoreError)  # alone in its group: no SAVEPOINT
    stack.service.writer.run(lambda tx: tx.session.add(NamespaceRow(id="next0000", spec={}, created_at=0.0)))
    assert stack.service.writer.groups == groups + 2
    with stack.service.sessions() as session:
        assert session.get(NamespaceRow, "good0000") is not None
        assert session.get(NamespaceRow, "bad00000") is None
        assert session.get(NamespaceRow, "next0000") is not None


def _try(call, *args):
    try:
        return call(*args)
    except KVStoreError as exc:
        return exc


def test_a_source_that_fails_its_checksum_before_demotion_is_invalidated(database_url):
    def corrupt(req: moving.MoveRequest) -> moving.MoveResult:
        n = len(req.items)
        return moving.MoveResult(ok=[False] * n, errors=["checksum mismatch in DRAM before demotion"] * n,
                                codes=["source_corrupt"] * n)

    with two_tier_stack(database_url, corrupt) as (s, worker):
        complete(s, prepare(s, chain(3)))
        s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10))
        assert hits(s, chain(3)) == 0  # before: the corrupt source went back to READY for good
        s.service.calls.settle()
        assert worker.allocators['nvme'].free_pages == 64  # the destination went back too
        index_matches_sql(s.service)


def test_a_source_dropped_while_it_is_copied_up_stays_deleting(database_url):
    """A promotion keeps its source; if the source was dropped meanwhile (an eviction, a failed
    checksum: DELETING), it stays DELETING when the copy finishes and is collected (before: set
    READY again)."""
    drop_during_copy = threading.Event()

    def drop(tx) -> None:
        for replica in tx.session.scalars(select(Replica).where(Replica.state == "moving")):
            replica.state = "deleting"

    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        if drop_during_copy.is_set() and req.items[0].dst_kind == "dram":
            s.service.writer.run(drop)  # the NVMe source, MOVING while it is copied
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, mover) as (s, worker):
        hashes = chain(1)
        complete(s, prepare(s, hashes))
        s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10))
        assert s.client.lookup(s.namespace_id, hashes, locations=True).tiers() == ["nvme"]
        drop_during_copy.set()
        s.client.prepare_load(specs.PrepareLoad(namespace_id=s.namespace_id, hashes=hashes))  # copied up
        with s.service.sessions() as session:
            nvme = list(session.scalars(select(Tier.id).where(Tier.kind == "nvme")))
            states = list(session.scalars(select(Replica.state).where(Replica.tier_id.in_(nvme))))
        assert states in ([], ["deleting"]), states  # gone once nothing pins it; never READY again
        index_matches_sql(s.service)


def test_the_worker_places_a_demotions_nvme_pages_and_the_directory_records_them(database_url):
    """A move to NVMe carries no destination pages: the worker takes them under the move's token
    and names them in its answer, which the directory records (one job before the move, one
    after); a dropped block gives exactly those pages back."""
    seen: list[moving.MoveItem] = []

    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        seen.extend(req.items)
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, mover) as (s, worker):
        complete(s, prepare(s, chain(3)))
        assert s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10)).demoted == 3
        nvme = worker.allocators["nvme"]
        assert nvme.free_pages == 64 - 6 and all(not item.allocate and nvme.owns(item.dst_token, item.dst_runs)
                                                 for item in seen)
        with s.service.sessions() as session:
            recorded = sorted(session.scalars(select(Replica.pages).join(Tier, Tier.id == Replica.tier_id)
                                              .where(Tier.kind == "nvme", Replica.state == "ready")))
        assert recorded == sorted([[r.first, r.count] for r in item.dst_runs] for item in seen)
        assert hits(s, chain(3)) == 3
        index_matches_sql(s.service)
        s.client.evict(s.namespace_id)
        s.service.calls.settle()
        assert nvme.free_pages == 64


def test_a_demotion_the_worker_has_no_nvme_pages_for_leaves_the_blocks_where_they_are(database_url):
    """The directory counts the NVMe tier's bytes, the worker its pages: when the worker has fewer
    free than the directory thought (here another holder took them), what it could not place stays
    in DRAM, reserves nothing and leaks nothing."""
    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, mover) as (s, worker):
        nvme = worker.allocators["nvme"]
        assert nvme.allocate("someone-else", 62 * PAGE) is not None  # room for one block of 2 pages
        complete(s, prepare(s, chain(3)))
        assert s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10)).demoted == 1
        assert hits(s, chain(3)) == 3 and s.client.stats().reservations == 0
        assert nvme.free_pages == 0
        with s.service.sessions() as session:
            used = session.scalar(select(Tier.used_bytes).where(Tier.kind == "nvme"))
        assert used == 2 * PAGE  # the one block placed; nothing held for the two that were not
        index_matches_sql(s.service)
        s.client.evict(s.namespace_id)
        s.service.calls.settle()
        assert nvme.free_pages == 2 and nvme.owned_tokens() == {"someone-else"}


def test_pages_the_worker_names_for_a_destination_dropped_meanwhile_go_back(database_url):
    """While the worker copies, the destination's row is dropped (its worker joined again, or the
    deadline passed): the pages the answer names are given back, and the block stays where it was."""
    def drop(tx) -> None:
        for replica in tx.session.scalars(select(Replica).where(Replica.state == "writing")):
            tx.session.delete(replica)

    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        s.service.writer.run(drop)
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, mover) as (s, worker):
        complete(s, prepare(s, chain(2)))
        assert s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10)).demoted == 0
        s.service.calls.settle()
        assert worker.allocators["nvme"].free_pages == 64 and hits(s, chain(2)) == 2
        assert s.client.lookup(s.namespace_id, chain(2), locations=True).tiers() == ["dram", "dram"]


def test_a_block_a_rejoining_worker_reports_from_a_move_whose_answer_was_lost_is_adopted_and_kept(database_url):
    """The directory stops waiting for a demotion; the worker, still copying, joins again (a new
    epoch) and reports the block it placed on NVMe under the move's token. The directory adopts it
    as READY with the pages the worker names, and nothing later gives those pages back: the
    destination it reserved went with the old epoch, so there is no token left to free whole."""
    go, seen = threading.Event(), []

    def slow(req: moving.MoveRequest) -> moving.MoveResult:
        seen.extend(req.items)
        go.wait(30)
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, slow, move_timeout_s=1.0) as (s, worker):
        hashes = chain(1)
        complete(s, prepare(s, hashes))
        assert s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10)).demoted == 0  # no answer in time
        (placed,) = seen
        nvme = worker.allocators["nvme"]
        assert nvme.owns(placed.dst_token, placed.dst_runs) and nvme.free_pages == 62
        s.client.register_worker(registration("w0", worker.url, backends=["UCX", "POSIX"], inventory=[
            specs.Survivor(kind="nvme", token=placed.dst_token, runs=placed.dst_runs, namespace_id=s.namespace_id,
                           hash=placed.hash, nbytes=placed.nbytes, checksum=placed.checksum)],
            tiers=[dram_tier(32), specs.TierSpec(kind="nvme", capacity_bytes=64 * PAGE, page_bytes=PAGE)]))
        go.set()
        for _ in range(3):  # the reaper's rounds: lost answers settled, expired reservations dropped
            s.service.reap()
        s.service.calls.settle()
        found = s.client.lookup(s.namespace_id, hashes, locations=True)
        assert found.tiers() == ["nvme"] and s.client.stats().reservations == 0
        assert nvme.owns(placed.dst_token, placed.dst_runs) and nvme.free_pages == 62  # still held: the block's
        index_matches_sql(s.service)


@pytest.mark.parametrize("stuck", [False, True], ids=["worker-stops", "nixl-request-stuck"])
def test_a_move_without_an_answer_keeps_its_destination_while_the_worker_may_write(database_url, stuck):
    """The directory stops waiting after move_timeout_s; the worker may still be writing, so the
    destination pages stay reserved. Once the worker says nothing writes under the move's token any
    more, they go back (before the deadline); if it cannot say so (a NIXL request of the move
    timed out while posted), they go back at the move's deadline."""
    answered, go = threading.Event(), threading.Event()

    def slow(req: moving.MoveRequest) -> moving.MoveResult:
        assert req.expires_at is not None and req.expires_at > time.time()
        go.wait(30)  # longer than the directory waits: until the test has looked
        if stuck:
            worker.fence.stuck({item.dst_token for item in req.items}, SimpleNamespace(settled=lambda: False))
        answered.set()
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, slow, move_timeout_s=2.0) as (s, worker):
        complete(s, prepare(s, chain(2)))
        outcome = s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10))
        assert outcome.demoted == 0
        assert worker.allocators['nvme'].free_pages == 64 - 4 and s.client.stats().reservations == 2  # still reserved
        with s.service.sessions() as session:
            expires_at = session.scalar(select(Replica.expires_at).where(Replica.state == "writing"))
        assert hits(s, chain(2)) == 2  # the source is READY again
        assert not answered.is_set()
        go.set()
        wait_until(lambda: s.client.stats().reservations == 0, 15, "the destination rolled back")
        assert answered.is_set()  # never while the worker was writing
        assert (time.time() >= expires_at) is stuck  # settled by the worker, or by the deadline
        wait_until(lambda: worker.allocators['nvme'].free_pages == 64, 5, "its pages back on the worker")
        index_matches_sql(s.service)


def test_a_worker_grants_at_most_its_free_pages_and_only_of_memory_tiers():
    import httpx

    with worker_endpoint(8, nvme_pages=8) as control:
        grant = lambda body: httpx.post(control.url + "/v1/grant", json=body, timeout=10)  # noqa: E731
        first = grant({"token": "g1", "kind": "dram", "max_pages": 6})
        assert first.status_code == 200 and first.json()["runs"] == [{"first": 0, "count": 6}]
        assert grant({"token": "g2", "kind": "dram", "max_pages": 6}).json()["runs"] == [{"first": 6, "count": 2}]
        assert grant({"token": "g3", "kind": "dram", "max_pages": 6}).json()["runs"] == []  # nothing left
        refused = grant({"token": "g4", "kind": "nvme", "max_pages": 1})
        assert refused.status_code == 400 and refused.json()["error"] == "invalid"
        assert grant({"token": "g5", "kind": "dram", "max_pages": 0}).status_code == 400
        assert grant({"token": "x" * 65, "kind": "dram", "max_pages": 1}).status_code == 400
