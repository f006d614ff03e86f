"""Where new blocks go when several workers have room: a worker on the engine's own host first
(the hosts a save names), else the one with the most page credit left."""

from __future__ import annotations

from kvstore.core import specs
from kvstore.core.inspection import InspectRequest
from tests.calls import BLOCK, chain, complete, prepare
from tests.stacks import PAGE, dram_tier, registration, worker_endpoint


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


def test_an_hbm_tier_on_another_gpu_names_its_device_in_every_location(stack):
    dram = stack.http.post("/v1/store/prepare", json={"namespace_id": stack.namespace_id, "blocks": [
        {"hash": h, "parent": None, "nbytes": BLOCK} for h in chain(1, start=500)]}).json()["blocks"][0]["location"]
    assert dram["tier"] == "dram" and "device" not in dram  # as before: an engine of before devices reads it
    with worker_endpoint(hbm_pages=32) as gpu_worker:
        stack.client.register_worker(registration("w1", gpu_worker.url, tiers=[dram_tier(32), specs.TierSpec(
            kind="hbm", capacity_bytes=32 * PAGE, page_bytes=PAGE, base_addr=1 << 40, device=3)]))
        hashes = chain(2)
        prepared = prepare(stack, hashes)  # new blocks go to the fastest tier: w1's HBM
        assert {(b.location.worker, b.location.tier, b.location.device) for b in prepared.blocks} == {("w1", "hbm", 3)}
        assert all(addr >= 1 << 40 for b in prepared.blocks for addr, _ in b.location.runs)
        complete(stack, prepared)
        looked = stack.client.lookup(stack.namespace_id, hashes, locations=True).blocks
        loads = stack.client.prepare_loads(specs.PrepareLoads(namespace_id=stack.namespace_id, chains=[hashes]))
        assert [b.location.device for b in looked] == [3, 3] and [b.location.device for b in loads.chains[0]] == [3, 3]
        stack.client.complete_load(specs.CompleteLoad(token=loads.token, blocks=[
            specs.BlockRead(hash=h, ok=True) for h in hashes]))
