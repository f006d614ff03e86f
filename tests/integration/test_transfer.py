"""The NIXL wrapper with real UCX agents (two in this process, each with its progress thread).

Byte-movement checks: source unchanged, every mapped destination equals its source,
every unmapped destination untouched."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent, joined
from tests.helpers import wait_until

PAGE, PAGES = 4096, 16


@pytest.fixture(scope="module")
def pair():
    target, initiator = Agent("t-target", {"UCX": {}}), Agent("t-initiator", {"UCX": {}})
    remote, local = HostBuffer(PAGE * PAGES), HostBuffer(PAGE * PAGES)
    target.register_dram(remote.addr, remote.nbytes)
    initiator.register_dram(local.addr, local.nbytes)
    peer = initiator.add_peer(target.metadata())
    target.add_peer(initiator.metadata())  # only needed for notifications back
    yield initiator, target, peer, local, remote
    initiator.close()
    target.close()


def pages(buffer: HostBuffer, idx) -> np.ndarray:
    return np.array([(buffer.addr + i * PAGE, PAGE) for i in idx], dtype=np.uint64)


def fill(buffer: HostBuffer, seed: int) -> np.ndarray:
    buffer.array[:] = np.random.default_rng(seed).integers(0, 256, buffer.nbytes, dtype=np.uint8)
    return buffer.array.copy()


def test_write_then_read_moves_exactly_the_mapped_pages(pair):
    initiator, _, peer, local, remote = pair
    src, dst_before = fill(local, 1), fill(remote, 2)
    t = initiator.submit("WRITE", pages(local, [0, 1, 5]), pages(remote, [3, 4, 9]), peer)
    assert t.wait(10) == "done" and t.nbytes == 3 * PAGE
    r = remote.array.reshape(PAGES, PAGE)
    assert np.array_equal(local.array, src)  # source unchanged
    for s, d in ((0, 3), (1, 4), (5, 9)):
        assert np.array_equal(r[d], src.reshape(PAGES, PAGE)[s])  # mapped destinations
    untouched = [i for i in range(PAGES) if i not in (3, 4, 9)]
    assert np.array_equal(r[untouched], dst_before.reshape(PAGES, PAGE)[untouched])

    local.array[:] = 0
    remote_before = remote.array.copy()
    t = initiator.submit("READ", pages(local, [7]), pages(remote, [9]), peer)
    assert t.wait(10) == "done"
    assert np.array_equal(remote.array, remote_before)  # the read's source unchanged
    assert np.array_equal(local.array.reshape(PAGES, PAGE)[7], src.reshape(PAGES, PAGE)[5])
    assert not local.array.reshape(PAGES, PAGE)[[i for i in range(PAGES) if i != 7]].any()


def test_prepared_lists_pick_rows_by_index_and_notify_the_peer(pair):
    initiator, target, peer, local, remote = pair
    target.notifications()  # drop anything earlier
    src = fill(local, 3)
    before = fill(remote, 4)
    lp = initiator.prepare(pages(local, range(PAGES)))
    rp = initiator.prepare(pages(remote, range(PAGES)), peer)
    t = initiator.submit_prepared("WRITE", lp, np.array([2, 3, 4]), rp, np.array([10, 11, 12]),
                                  notification=b"blocks 10-12 written")
    assert t.wait(10) == "done" and t.nbytes == 3 * PAGE
    r = remote.array.reshape(PAGES, PAGE)
    assert np.array_equal(local.array, src)  # source unchanged
    assert np.array_equal(r[10:13], src.reshape(PAGES, PAGE)[2:5])  # every mapped destination
    untouched = [i for i in range(PAGES) if i not in (10, 11, 12)]
    assert np.array_equal(r[untouched], before.reshape(PAGES, PAGE)[untouched])  # the rest untouched
    received = {}
    wait_until(lambda: received.update(target.notifications()) or received, 10, "notification")
    assert received == {"t-initiator": [b"blocks 10-12 written"]}
    initiator.release(lp)
    initiator.release(rp)


def test_a_transfer_outside_registered_memory_fails_as_a_value(pair):
    initiator, _, peer, local, remote = pair
    outside = np.array([(remote.addr + remote.nbytes, PAGE)], dtype=np.uint64)
    t = initiator.submit("WRITE", pages(local, [0]), outside, peer)
    assert t.wait(10) == "failed" and "NotFound" in t.error
    t = initiator.submit("WRITE", pages(local, [0]), pages(remote, [0]), "no-such-peer")
    assert t.state == "failed"


def test_rows_that_follow_each_other_are_joined_into_pieces_of_about_the_limit():
    rows = np.array([(1000 + i * PAGE, PAGE) for i in range(10)], dtype=np.uint64)
    far = rows.copy()
    far[:, 0] += 1 << 30
    local, remote = joined(rows, far, 4 * PAGE)
    assert local.tolist() == [[1000, 4 * PAGE], [1000 + 4 * PAGE, 4 * PAGE], [1000 + 8 * PAGE, 2 * PAGE]]
    assert remote.tolist() == [[a + (1 << 30), n] for a, n in local.tolist()]
    far[5:, 0] += PAGE  # a gap on one side ends a run there; the next run counts its pieces from 0
    local, remote = joined(rows, far, 4 * PAGE)
    assert [n // PAGE for _, n in local.tolist()] == [4, 1, 4, 1]
    assert remote[:, 0].tolist() == [far[0, 0], far[4, 0], far[5, 0], far[9, 0]]
    assert joined(rows, far, PAGE)[0].tolist() == rows.tolist()  # rows of the limit stay as they are
    sizes = [PAGE, 8 * PAGE, PAGE, PAGE]  # a row of the limit or more stands alone, whatever is around it
    mixed = np.array([(1000 + sum(sizes[:i]), n) for i, n in enumerate(sizes)], dtype=np.uint64)
    assert [n // PAGE for _, n in joined(mixed, mixed, 4 * PAGE)[0].tolist()] == [1, 8, 2]
    top = np.array([((1 << 64) - PAGE, PAGE), (0, PAGE)], dtype=np.uint64)  # ends at 2**64: nothing follows it
    assert len(joined(rows[:2], top, 4 * PAGE)[0]) == 2
    files = np.column_stack([rows, [3] * 5 + [4] * 5]).astype(np.uint64)  # (offset, len, fd): one file each
    assert [n // PAGE for _, n, _ in joined(files, np.column_stack([rows[:, 0] + (1 << 30), rows[:, 1], [0] * 10])
                                            .astype(np.uint64), 64 * PAGE)[0].tolist()] == [5, 5]


def test_a_joined_request_moves_the_same_bytes_and_falls_back_where_registrations_touch(caplog):
    """Joined rows write what the rows name; where two of this side's registrations touch, the
    agent knows it and never asks; where two of the peer's touch, NIXL refuses a row that spans
    both, the rows are posted as given, and that peer's are from then on (no second refusal)."""
    target, initiator = Agent("j-target", {"UCX": {}}), Agent("j-initiator", {"UCX": {}})
    remote, local = HostBuffer(PAGE * PAGES), HostBuffer(PAGE * PAGES)
    try:
        half = PAGE * PAGES // 2
        for agent, buffer in ((target, remote), (initiator, local)):  # two registrations that touch, each side
            agent.register_dram(buffer.addr, half)
            agent.register_dram(buffer.addr + half, half)
        peer = initiator.add_peer(target.metadata())
        for here, there, refused in ((range(4), range(4), False), (range(6, 10), range(4), False),
                                     (range(4), range(6, 10), True), (range(4), range(6, 10), False)):
            src, before = fill(local, 5), fill(remote, 6)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="kvstore.transfer.agent"):
                t = initiator.submit("WRITE", pages(local, here), pages(remote, there), peer, join_up_to=8 * PAGE)
                assert t.wait(10) == "done" and t.nbytes == 4 * PAGE, t.error
            assert ("NIXL refused" in caplog.text) == refused, (here, there)
            r = remote.array.reshape(PAGES, PAGE)
            assert np.array_equal(r[list(there)], src.reshape(PAGES, PAGE)[list(here)])
            untouched = [i for i in range(PAGES) if i not in there]
            assert np.array_equal(r[untouched], before.reshape(PAGES, PAGE)[untouched])
    finally:
        initiator.close()
        target.close()


def test_metadata_nixl_cannot_load_is_a_kvstore_error_not_a_nixl_one():
    """A peer whose metadata NIXL cannot load (garbage here; in a cluster, a worker that died
    before the directory noticed) is `unavailable`, which callers treat as a miss."""
    agent = Agent(f"bad-peer-{uuid.uuid4().hex[:8]}", backends={"UCX": {}})
    try:
        with pytest.raises(KVStoreError) as refused:
            agent.add_peer(b"these bytes are not NIXL agent metadata")
        assert refused.value.kind == "unavailable" and "metadata" in refused.value.message
    finally:
        agent.close()


def test_the_nixl_build_is_chosen_by_kvstore_nixl_module():
    """KVSTORE_NIXL_MODULE names the NIXL build to import (nixl_cu13 on a CUDA 13 host); one that is
    not installed fails at import, naming it, rather than falling back to another build."""
    probe = "import kvstore.transfer.agent as a; print(a.nixl_api.__name__)"
    unset = {k: v for k, v in os.environ.items() if k != "KVSTORE_NIXL_MODULE"}
    default = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=unset)
    assert default.returncode == 0 and default.stdout.strip() == "nixl_cu12._api", default.stderr
    missing = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "KVSTORE_NIXL_MODULE": "nixl_cu99"})
    assert missing.returncode != 0 and "nixl_cu99" in missing.stderr, missing.stderr
