"""Three directory replicas on one PostgreSQL database and three workers on distinct loopback
addresses (standing for hosts) with DRAM, NVMe and an S3 tier (moto), as real processes, while two engines save and load in a loop in a
namespace whose blocks are kept on two workers (`replicas` 2):

(a) the leading replica is SIGKILLed: a follower takes over, the engines see no exception and at
    most 3 s of misses; the killed replica comes back as a follower;
(b) a following replica is SIGKILLed: the engines that used it move on at once;
(c) a worker is drained: its DRAM blocks go to the other workers (worker to worker), none to its
    own NVMe, and every block is on two workers again;
(d) a worker is SIGKILLed while the engines load, once every block is on two workers: no prefix
    is lost (then a new engine loads every prompt whole at its first try).

Throughout, every load is byte-exact or a miss; at the end pins, leases and reservations are back
to 0 and every surviving replica answers the same /v1/admin/stats and lookups. The failover times
measured are printed (pytest -s shows them)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import DirectoryClient
from kvstore.core.inspection import InspectRequest
from kvstore.core.specs import NamespacePolicy
from tests.fault.conftest import SETTLE_S, TTL_S
from tests.fault.loop_engine import BLOCKS, NAMESPACE, PROMPTS, chains
from tests.helpers import wait_until
from tests.stacks import ReplicaCluster, s3_bucket
from tests.unit.test_deploy import expressions, metric_names

pytestmark = pytest.mark.postgres
PER_PROCESS = ("leader", "commit_groups", "committed_jobs", "follower_lag_s")  # what differs between replicas by design
# a dead worker's copies into another worker's DRAM are held until their deadline (the move timeout
# plus up to 30 s): it may only be cut off, and still writing
MOVE_TIMEOUT_S = 15.0
IDLE_S = 60.0  # after the engines stop, until no pin, lease or reservation is left


@pytest.fixture
def cluster(tmp_path, postgres, monkeypatch):
    with s3_bucket(tmp_path, monkeypatch, "kv-replicas") as moto:
        c = ReplicaCluster(tmp_path, postgres.create_database(), moto.url, "kv-replicas", TTL_S, MOVE_TIMEOUT_S)
        try:
            c.start()
            yield c
        finally:
            c.close()


def workers_per_block(client: DirectoryClient, seeds=(1, 2)) -> list[set[str]]:
    """For every block of the engines' prompts, the workers holding it (READY, any tier but S3)."""
    held = []
    for seed in seeds:
        for chain in chains(seed):
            result = client.inspect(InspectRequest(namespace_id=NAMESPACE.namespace_id, hashes=chain))
            held += [{r.worker for r in b.replicas if r.state == "ready" and r.tier != "s3"} for b in result.blocks]
    return held


def hits_after(c: ReplicaCluster, t: float, markers: list[Path]) -> None:
    """Wait until each engine has loaded a whole prompt after `t` (the store serves again)."""
    def served() -> bool:
        return all((m / "last_exact").exists() and float((m / "last_exact").read_text()) > t for m in markers)
    wait_until(served, 60, "an exact load by every engine")


def same_stats(c: ReplicaCluster) -> dict:
    """Every live replica answers the same stats (per-process counters aside), within the settle time."""
    def agree() -> bool:
        seen = [{k: v for k, v in c.client(i).stats().model_dump().items() if k not in PER_PROCESS} for i in c.live()]
        return all(s == seen[0] for s in seen)
    wait_until(agree, SETTLE_S, "the same stats on every live replica")
    return c.client(c.live()[0]).stats().model_dump()


def test_replicas_and_workers_fail_without_engine_errors_or_wrong_bytes(cluster):
    c = cluster
    assert c.leader() == 0  # the first to start took the lead
    assert not c.client(1).stats().leader and not c.client(2).stats().leader
    any_replica = DirectoryClient(c.urls)
    any_replica.register_namespace(NAMESPACE)
    assert any_replica.set_policy(NAMESPACE.namespace_id, NamespacePolicy(replicas=2)).replicas == 2
    # engines list the replicas in different orders: one talks to the leader, one to a follower
    engines = [c.engine(c.urls, seed=1), c.engine(",".join(c.url(i) for i in (1, 2, 0)), seed=2)]
    markers = [m for _, m in engines]
    wait_until(lambda: all((m / "ready").exists() for m in markers), 120, "a first round by every engine")
    timings = {}

    # (a) the leader dies
    killed = c.kill_replica(0)
    wait_until(lambda: c.leader() is not None, 15, "a new leader")
    timings["new_leader_s"] = time.time() - killed
    hits_after(c, killed, markers)
    timings["exact_loads_again_s"] = time.time() - killed
    assert timings["exact_loads_again_s"] < 3.0, timings  # at most 3 s of misses
    c.start_replica(0)  # back as a follower
    assert not c.client(0).stats().leader

    # (b) a follower dies
    follower = next(i for i in c.live() if i != c.leader())
    killed = c.kill_replica(follower)
    hits_after(c, killed, markers)
    timings["follower_death_exact_loads_again_s"] = time.time() - killed
    assert timings["follower_death_exact_loads_again_s"] < 3.0, timings
    assert c.leader() is not None and c.leader() != follower

    # (c) a worker drains: its DRAM goes to the other workers, not to its own NVMe
    any_replica.drain("w0")
    c.wait(lambda: any_replica.worker("w0").state == "drained", 60, "w0 drained")
    drained = time.time()
    hits_after(c, drained, markers)
    held = workers_per_block(any_replica)
    assert held and all(workers and "w0" not in workers for workers in held), held  # each block on another
    # worker, none left on w0 (NVMe included)

    # (d) a worker dies, while the engines load, once every block is on two workers: nothing is lost
    c.wait(lambda: all(held == {"w1", "w2"} for held in workers_per_block(any_replica)), 60,
               "every block on w1 and w2")
    c.workers["w1"].send_signal(signal.SIGKILL)
    killed = time.time()
    wait_until(lambda: any_replica.worker("w1").state == "dead", 30, "w1 dead")
    hits_after(c, killed, markers)
    for _, m in engines:
        (m / "stop").touch()
    results = []
    for (proc, _), seed in zip(engines, (1, 2)):
        assert proc.wait(timeout=120) == 0, (c.tmp / f"engine-{seed}.log").read_text()[-3000:]
        results.append(json.loads((c.tmp / f"engine-{seed}.json").read_text()))
    for seed in (1, 2):
        proc, _ = c.engine(c.urls, seed, "-after", "--rounds", "1")
        assert proc.wait(timeout=120) == 0, (c.tmp / f"engine-{seed}-after.log").read_text()[-3000:]
        after = json.loads((c.tmp / f"engine-{seed}-after.json").read_text())
        assert after["errors"] == [] and [e[2] for e in after["events"]] == ["exact"] * PROMPTS, after["events"]

    for r in results:
        assert r["errors"] == [], r["errors"][:2]  # the store is a cache: no exception reaches an engine
        outcomes = [e[2] for e in r["events"] if e[1] == "load"]
        assert "wrong" not in outcomes  # never a wrong byte
        assert outcomes.count("exact") > len(outcomes) // 3, outcomes
    assert c.leader() is not None
    stats = same_stats(c)
    for seed in (1, 2):  # every live replica finds every prefix whole
        found = [[c.client(i).lookup(NAMESPACE.namespace_id, chain).num_hit_blocks for chain in chains(seed)]
                 for i in c.live()]
        assert all(f == [BLOCKS] * PROMPTS for f in found), found
    outstanding = lambda: {i: ((s := c.client(i).stats()).pins, s.leases_active, s.reservations)  # noqa: E731
                           for i in c.live()}
    # the leader's reaper may be busy a while with moves to S3 (moto) before it expires the rest
    c.wait(lambda: all(v == (0, 0, 0) for v in outstanding().values()), IDLE_S, "no pins, leases or reservations")
    metrics_add_up(c, any_replica)
    print(f"\nreplica failover: {json.dumps(timings)}; final stats {stats}")


def scrape(url: str) -> dict[str, list]:
    """Series name (as PromQL names it: counters with _total) -> [(labels, value)] of a real /metrics."""
    series: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        names = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [""])
        for suffix in names:
            series.setdefault(family.name + suffix, [])
        for sample in family.samples:
            series.setdefault(sample.name, []).append((sample.labels, sample.value))
    return series


def metrics_add_up(c: ReplicaCluster, client: DirectoryClient) -> None:
    """The replicas' and workers' real /metrics: one leader, the cluster's gauges from it alone (a
    sum over replicas counts each replica once), and every alert's and panel's metric exported."""
    replicas = {i: scrape(c.url(i)) for i in c.live()}
    workers = [scrape(w.control_url) for w in client.workers() if w.state != "dead"]
    leaders = [i for i, s in replicas.items() if s["kvstore_leader"] == [({}, 1.0)]]
    assert leaders == [c.leader()], leaders
    by_tier: dict[str, float] = {}  # sum by (tier) (kvstore_tier_replicas) over every replica's scrape
    for series in replicas.values():
        for labels, value in series.get("kvstore_tier_replicas", []):
            by_tier[labels["tier"]] = by_tier.get(labels["tier"], 0.0) + value
    assert by_tier == {k: float(v) for k, v in client.stats().replicas_by_tier.items()}, by_tier
    for i, series in replicas.items():
        cluster_wide = [series.get(n, []) for n in ("kvstore_blocks", "kvstore_leases_active", "kvstore_workers")]
        assert all(cluster_wide) == (i in leaders), (i, cluster_wide)
        assert series["kvstore_build_info"] and series["process_resident_memory_bytes"][0][1] > 0
    exported = {name for s in [*replicas.values(), *workers] for name in s}
    for where, expr in expressions().items():
        assert metric_names(expr) <= exported, (where, sorted(metric_names(expr) - exported))
