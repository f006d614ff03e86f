"""Duplicate, out-of-order, late and foreign completions against the real directory and worker:
each is a 409 with a clear message and changes nothing."""

from __future__ import annotations

import pytest

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace, block_hashes
from tests.fault.conftest import TTL_S
from tests.stacks import ProcessStack

@pytest.fixture
def stack(tmp_path):
    """The fault tests' stack, but reservations outlive a worker's restart: a new worker process
    may take longer than the 3 s TTL to register on a loaded machine, and a reservation that expires
    meanwhile is refused for its expiry, not for the restart this test is about."""
    s = ProcessStack(tmp_path, ttl_s=TTL_S, env={"KVSTORE_RESERVATION_TTL_S": "120"})
    s.start_directory()
    s.start_worker()
    yield s
    s.close()


NS = Namespace(model_id="completions", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)


def prepare(client, start: int, n: int = 2) -> specs.StorePrepared:
    hashes = [h.hex() for h in block_hashes(NS, list(range(start, start + 4 * n)))]
    return client.prepare_store(specs.PrepareStore(namespace_id=NS.namespace_id, blocks=[
        specs.BlockToStore(hash=h, parent=p, nbytes=NS.block_nbytes) for h, p in zip(hashes, [None] + hashes[:-1])]))


def written(prepared, ok=True) -> specs.CompleteStore:
    return specs.CompleteStore(token=prepared.token, blocks=[
        specs.BlockWritten(hash=b.hash, ok=ok, checksum="0123456789abcdef") for b in prepared.blocks])


def held(client) -> dict:
    """What the directory holds (not its counters of work done, which heartbeats move)."""
    return client.stats().model_dump(exclude={"commit_groups", "committed_jobs"})


def conflict(call, *args) -> str:
    with pytest.raises(KVStoreError) as info:
        call(*args)
    assert info.value.kind == "conflict"
    return str(info.value)


def test_duplicate_out_of_order_and_stale_completions_are_409_and_change_nothing(stack):
    client = stack.client
    client.register_namespace(NS)
    first = prepare(client, 0)
    assert client.complete_store(written(first)).committed == 2
    before = held(client)
    assert "unknown, completed or rolled-back" in conflict(client.complete_store, written(first))  # duplicate
    assert held(client) == before

    aborted = prepare(client, 100)
    client.abort_store(aborted.token)
    conflict(client.complete_store, written(aborted))  # completion after an abort
    conflict(client.complete_load, specs.CompleteLoad(token="f" * 32))  # a load never prepared
    conflict(client.renew, "f" * 32)

    hashes = [b.hash for b in first.blocks]
    load = client.prepare_load(specs.PrepareLoad(namespace_id=NS.namespace_id, hashes=hashes))
    client.complete_load(specs.CompleteLoad(token=load.token))
    conflict(client.complete_load, specs.CompleteLoad(token=load.token))  # twice

    late = prepare(client, 200)  # the worker restarts between prepare and complete: a new epoch
    stack.kill(stack.worker)
    assert stack.start_worker() == 2
    assert "restarted" in conflict(client.complete_store, written(late))
    assert "ended already (the worker restarted" in conflict(client.complete_store, written(late))  # twice
    assert client.lookup(NS.namespace_id, [b.hash for b in late.blocks]).num_hit_blocks == 0
    assert client.lookup(NS.namespace_id, hashes).num_hit_blocks == 0  # memory replicas of epoch 1 are gone
    stack.settled()
