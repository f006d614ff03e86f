"""Where new blocks go when several workers have room: a worker on the engine's own host first
(the hosts a save names), else the one with the most page credit left."""

from __future__ import annotations

from kvstore.core import specs
from kvstore.core.inspection import InspectRequest
from tests.calls import BLOCK, chain, complete
from tests.stacks import PAGE, worker_endpoint


def save(stack, hashes: list[str], hosts: list[str]) -> set[str]:
    """Save a prefix naming `hosts`; the workers its replicas went to."""
    prepared = stack.client.prepare_store(specs.PrepareStore(namespace_id=stack.namespace_id, hosts=hosts, blocks=[
        specs.BlockToStore(hash=h, parent=p, nbytes=BLOCK) for h, p in zip(hashes, [None] + hashes)]))
    assert all(b.status == "admitted" for b in prepared.blocks), prepared.blocks
    complete(stack, prepared)
    blocks = stack.client.inspect(InspectRequest(namespace_id=stack.namespace_id, hashes=hashes)).blocks
    return {r.worker for b in blocks for r in b.replicas}


def test_a_save_goes_to_a_worker_on_the_engines_host_while_it_has_room(stack):
    with worker_endpoint(host="127.0.0.2") as other_host:
        stack.register_worker(name="w1", control_url=other_host.url)
        assert other_host.url.startswith("http://127.0.0.2:")
        assert save(stack, chain(2), ["engine-b", "127.0.0.2"]) == {"w1"}
        assert save(stack, chain(2, start=100), ["127.0.0.1"]) == {"w0"}
        assert save(stack, chain(14, start=200), ["127.0.0.2"]) == {"w1"}  # the 28 pages w1 had left
        # w1 is full: a save it cannot hold goes where there is most room
        assert save(stack, chain(1, start=300), ["127.0.0.2"]) == {"w0"}
        assert save(stack, chain(1, start=400), []) == {"w0"}  # no host named: the most credit left
        assert [t.used_bytes for t in sorted(stack.client.tiers(), key=lambda t: t.worker)] == [
            (2 + 1 + 1) * BLOCK, 32 * PAGE]
