"""Control traffic is never queued behind data traffic: with every load waiting on a worker that
stopped answering (a promotion from NVMe each), heartbeats, lease renewals and health checks still
answer at once."""

from __future__ import annotations

import threading

import httpx

from kvstore.client import DirectoryClient
from kvstore.core import moving, specs
from tests.calls import chain, complete, prepare
from tests.stacks import two_tier_stack

LOADS = 48  # more than the framework's 40 threads; each promotion reserves 4 DRAM pages


def test_heartbeats_renewals_and_health_answer_while_every_load_waits_on_a_hung_worker(database_url):
    stopped, resume = threading.Event(), threading.Event()

    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        if stopped.is_set():
            resume.wait(60)  # a worker stopped (SIGSTOP, a dying disk): no answer
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[""] * n, codes=["ok"] * n)

    with two_tier_stack(database_url, mover, dram_pages=8 * LOADS, endpoint={"max_connections": 2 * LOADS},
                        move_timeout_s=30.0) as (s, _):
        hashes = chain(2)
        complete(s, prepare(s, hashes))
        s.client.evict_tier(specs.EvictRequest(tier="dram", limit=10))  # both blocks down to NVMe
        assert s.client.lookup(s.namespace_id, hashes, locations=True).tiers() == ["nvme", "nvme"]
        held = prepare(s, chain(1, start=100))  # a save in progress, whose reservation is renewed below
        stopped.set()

        def load() -> None:
            try:
                DirectoryClient(s.url, timeout_s=120).prepare_load(
                    specs.PrepareLoad(namespace_id=s.namespace_id, hashes=hashes))
            except Exception:  # noqa: BLE001 (what the loads get does not matter here)
                pass
        loads = [threading.Thread(target=load, daemon=True) for _ in range(LOADS)]
        try:
            for thread in loads:
                thread.start()
            threading.Event().wait(2.0)  # every load is in and waiting on the worker
            quick = DirectoryClient(s.url, timeout_s=5)  # before: each of these timed out
            epoch = quick.worker("w0").epoch
            quick.heartbeat("w0", epoch)
            assert quick.renew(held.token).token == held.token
            assert httpx.get(s.url + "/healthz", timeout=5).status_code == 200
            assert sum(t.is_alive() for t in loads) > 40  # the loads were indeed still waiting
        finally:
            resume.set()
            for thread in loads:
                thread.join(60)
