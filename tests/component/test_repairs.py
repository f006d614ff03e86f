"""What the directory repairs by itself after a step failed half-way: sources a failed move left
MOVING, block rows a rejoining worker's lost replicas left behind, an index that could not read
back a commit."""

from __future__ import annotations

import pytest

from kvstore.connector.calls import accepted as _accepted
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.inspection import InspectRequest
from kvstore.directory.db import direct, repository as repo
from kvstore.directory.db.models.replica import MOVING, WRITING
from kvstore.directory.db import moves as moves_sql
from tests.calls import BLOCK, chain, complete, hits, prepare
from tests.stacks import DEFAULT_MARKS, PAGE, dram_tier, registration


def states(stack, hashes) -> list[list[str]]:
    blocks = stack.client.inspect(InspectRequest(namespace_id=stack.namespace_id, hashes=hashes)).blocks
    return [sorted(r.state for r in b.replicas) for b in blocks]


def test_a_source_a_failed_move_left_moving_is_ready_again_once_no_move_copies_it(stack):
    hashes = chain(2)
    complete(stack, prepare(stack, hashes))

    def strand(tx) -> tuple[list[int], int]:
        blocks = repo.blocks_by_hash(tx.session, stack.namespace_id, hashes)
        for n, block in enumerate(blocks[h] for h in hashes):
            replica, tier, worker = repo.replicas_of(tx.session, [block.id])[0]
            replica.state = MOVING  # what a move's failed finish leaves
            if n == 1:  # this one's move is still copying: its destination is WRITING
                direct.insert_replicas(tx.session, [(block.id, tier.id, worker.epoch, "move-1-" + "0" * 32, [], 0, 0.0)],
                                       state=WRITING, expires_at=4e9)
        tx.session.flush()  # asked in the same transaction: the reaper's thread cannot run in between
        return [r.block_id for r in moves_sql.stranded_moving(tx.session)], blocks[hashes[0]].id
    stranded, first = stack.service.writer.run(strand)
    assert stranded == [first]  # the one whose move still copies is not touched
    stack.service.reap()
    assert states(stack, hashes)[0] == ["ready"]  # before: MOVING until a restart, never evicted


def test_a_rejoining_worker_s_lost_durable_replicas_take_their_block_rows_with_them(stack):
    kept, lost = chain(2)

    def survivor(block_hash: str, first: int) -> specs.Survivor:
        return specs.Survivor(kind="nvme", token=f"t{first}", runs=[specs.PageRun(first=first, count=2)],
                              namespace_id=stack.namespace_id, hash=block_hash, nbytes=BLOCK,
                              checksum="0123456789abcdef")

    def join(*inventory: specs.Survivor) -> None:
        stack.client.register_worker(registration(
            "w1", pid=2, backends=["UCX", "POSIX"], inventory=list(inventory),
            tiers=[dram_tier(32, base_addr=1 << 30, **DEFAULT_MARKS),
                   specs.TierSpec(kind="nvme", capacity_bytes=32 * PAGE, page_bytes=PAGE)]))
    join(survivor(kept, 0), survivor(lost, 2))
    assert hits(stack, [kept, lost]) == 2 and stack.client.stats().blocks == 2
    join(survivor(kept, 0))  # its disk lost the second block meanwhile
    assert hits(stack, [kept]) == 1 and hits(stack, [lost]) == 0
    assert stack.client.stats().blocks == 1  # before: 2, a block row with no replica left


def test_a_completion_asked_again_says_what_the_first_one_did_and_commits_nothing_twice(stack):
    """A client whose answer to complete_store was lost asks again (on another directory URL): it is
    refused as a duplicate (409, nothing changes) and told the first call committed, which the
    connector counts as stored (before: only 'unknown token', and a committed save counted as lost)."""
    prepared = prepare(stack, chain(2))
    assert complete(stack, prepared).committed == 2
    with pytest.raises(KVStoreError) as again:
        complete(stack, prepared)
    assert again.value.kind == "conflict"
    assert (again.value.context["completed"], again.value.context["committed"]) == (True, 2)
    stats = stack.client.stats()
    assert (stats.blocks, stats.replicas, stats.reservations) == (2, 2, 0)
    assert _accepted(stack.client.complete_store, specs.CompleteStore(token=prepared.token, blocks=[]))


def test_a_rebuild_keeps_the_newest_row_of_a_hash_saved_twice_and_gives_it_the_others_replicas(stack, caplog):
    """No unique index keeps one row per (namespace, hash): a row written again beside an old one
    (here by hand) is met by the leader's rebuild, which keeps the newest and says how many it found."""
    hashes = chain(2)
    complete(stack, prepare(stack, hashes))

    def duplicate(tx) -> tuple[int, int]:
        block = repo.blocks_by_hash(tx.session, stack.namespace_id, hashes[:1])[hashes[0]]
        replica, tier, worker = repo.replicas_of(tx.session, [block.id])[0]
        (new_id,), = direct.rows(tx.session, "SELECT max(id) + 1 FROM blocks")
        direct.execute(tx.session, "INSERT INTO blocks (id, namespace_id, hash, parent, depth, nbytes, checksum, "
                       "created_at, last_access, hit_count) SELECT ?, namespace_id, hash, parent, depth, nbytes, "
                       "checksum, created_at, last_access, hit_count FROM blocks WHERE id = ?", (new_id, block.id))
        direct.insert_replicas(tx.session, [(new_id, tier.id, worker.epoch, "copy", [[900, 2]], 2 * PAGE, 0.0)])
        return block.id, new_id
    old_id, new_id = stack.service.writer.run(duplicate)
    with caplog.at_level("WARNING", logger="kvstore.directory.db.index"):
        stack.service.reread(lambda session: None)
    assert "found 1 duplicate block rows" in caplog.text

    def rows(tx) -> list[tuple]:
        return direct.rows(tx.session, "SELECT b.id, count(r.id) FROM blocks b JOIN replicas r ON r.block_id = b.id "
                           "WHERE b.hash = ? GROUP BY b.id", (hashes[0],))
    assert [tuple(row) for row in stack.service.writer.run(rows)] == [(new_id, 2)]  # the old row's replica moved
    assert stack.service.index.ids(stack.namespace_id, hashes[:1]) == {hashes[0]: new_id} and old_id != new_id
    assert hits(stack, hashes) == 2
