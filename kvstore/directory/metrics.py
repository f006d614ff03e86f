"""Prometheus metrics of the directory (names prefixed `kvstore_`), two registries per app: this
replica's own (its requests, counters, `kvstore_leader`, `kvstore_build_info`, its process), and
the cluster's state read from the database (blocks, leases, tiers, workers), which only the
leading replica exports, so that a sum over replicas counts everything once.

Series labelled by worker exist for workers that are not dead: a worker that deregistered or was
declared dead leaves no series behind.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from kvstore import __version__

from kvstore.core import specs

REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
UNMATCHED = "unmatched"  # the route label of a request no route answers


class DirectoryMetrics:
    def __init__(self) -> None:
        self.registry, self.cluster = CollectorRegistry(), CollectorRegistry()
        r, c = self.registry, self.cluster
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds
        self.build_info = Gauge("kvstore_build_info", "kvstore's version and Python's (always 1)",
                                ["version", "python"], registry=r)
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.leader = Gauge("kvstore_leader", "1 on the directory replica that leads (it exports the cluster's "
                            "gauges), 0 on a follower", registry=r)
        self.lookups = Counter("kvstore_lookups", "Lookups and prepare_loads served", registry=r)
        self.lookup_blocks = Counter("kvstore_lookup_blocks", "Blocks asked for in lookups", registry=r)
        self.hit_blocks = Counter("kvstore_lookup_hit_blocks", "Leading blocks found in lookups", registry=r)
        self.store_decisions = Counter("kvstore_store_decisions", "prepare_store decisions per block; rejected "
                                       "ones by reason (no_space, not_admitted, throttled, parent_rejected, "
                                       "no_worker)", ["status", "reason"], registry=r)
        self.blocks_committed = Counter("kvstore_blocks_committed", "Blocks made visible by complete_store",
                                        registry=r)
        self.checksum_failures = Counter("kvstore_checksum_failures",
                                         "Replicas invalidated because a reader saw a checksum mismatch",
                                         registry=r)
        self.gauges = {name: Gauge(f"kvstore_{name}", help_, registry=c) for name, help_ in (
            ("blocks", "Blocks in the directory"), ("replicas", "Replicas in any state"),
            ("reservations", "Replicas being written (WRITING)"),
            ("leases_active", "Distinct reader leases"), ("pins", "Replicas pinned by leases"),
            ("workers_active", "Workers in state active"), ("inflight_moves", "Replicas being copied to another tier"))}
        self.follower_lag = Gauge("kvstore_follower_lag_seconds", "Seconds since this directory replica last "
                                  "read the leader's change log (0 on the leader; above 10 it is not ready)",
                                  registry=r)
        self.replicas_by_tier = Gauge("kvstore_tier_replicas", "Visible replicas per tier kind, all workers",
                                      ["tier"], registry=c)
        self.move_failures = Counter("kvstore_move_failures", "Blocks whose move between tiers failed, by route "
                                     "(src_dst)",
                                     ["route"], registry=r)
        self.tier_capacity = Gauge("kvstore_tier_capacity_bytes", "Tier capacity", ["worker", "kind"], registry=c)
        self.tier_used = Gauge("kvstore_tier_used_bytes", "Tier bytes reserved or used",
                               ["worker", "kind"], registry=c)
        self.tier_blocks = Gauge("kvstore_tier_blocks", "Visible replicas per tier", ["worker", "kind"], registry=c)
        self.tier_kv = Gauge("kvstore_tier_kv_bytes", "KV bytes of a tier's visible replicas (their pages: "
                             "kvstore_tier_block_bytes; the ratio is how much of the pages holds KV)",
                             ["worker", "kind"], registry=c)
        self.tier_block_bytes = Gauge("kvstore_tier_block_bytes", "Bytes of the pages a tier's visible replicas "
                                      "take", ["worker", "kind"], registry=c)
        self.tier_high = Gauge("kvstore_tier_high_watermark_ratio", "Fill ratio above which the reaper moves a "
                               "tier's blocks down", ["worker", "kind"], registry=c)
        self.tier_low = Gauge("kvstore_tier_low_watermark_ratio", "Fill ratio the reaper moves a tier down to",
                              ["worker", "kind"], registry=c)
        self.handoffs = Counter("kvstore_handoffs", "Hand-offs producers committed, by state (committed: their "
                                "saves are in; failed: the producer gave up)", ["state"], registry=r)
        self.handoff_latency = Histogram("kvstore_handoff_latency_seconds", "A hand-off's producer request "
                                         "finished -> its hand-off committed here (the producer's clock)",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.handoff_waits = Histogram("kvstore_handoff_wait_seconds", "One wait for a hand-off, by how it ended "
                                       "(committed, failed, present: its blocks are stored, pending: timed out)",
                                       ["outcome"], buckets=REQUEST_BUCKETS, registry=r)
        self.requests = Histogram("kvstore_request_seconds", "Time to answer a request, by route template, "
                                  "method and status", ["route", "method", "status"], buckets=REQUEST_BUCKETS,
                                  registry=r)
        self.heartbeat_age = Gauge("kvstore_heartbeat_age_seconds", "Seconds since a worker's last heartbeat "
                                   "(workers not dead)", ["worker"], registry=c)
        self.workers = Gauge("kvstore_workers", "Workers by state (active, draining, drained, dead)", ["state"],
                             registry=c)
        self.declared_dead = Counter("kvstore_workers_declared_dead", "Workers declared dead because their "
                                     "heartbeats stopped", registry=r)
        self._by_worker = (self.tier_capacity, self.tier_used, self.tier_blocks, self.tier_kv, self.tier_block_bytes,
                           self.tier_high, self.tier_low, self.heartbeat_age, self.workers)
        self._observers: dict[tuple[str, str, int], object] = {}
        self._render = threading.Lock()

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        observer = self._observers.get(key)
        if observer is None:  # labels() costs more than the observation; the label sets are few
            observer = self._observers[key] = self.requests.labels(route, method, str(status))
        observer.observe(seconds)

    def count_lookup(self, asked: int, hit: int) -> None:
        self.lookups.inc()
        self.lookup_blocks.inc(asked)
        self.hit_blocks.inc(hit)

    def count_store_decisions(self, decisions: Iterable[dict]) -> None:
        counts: dict[tuple[str, str], int] = {}
        for decision in decisions:
            key = (decision["status"], decision.get("reason") or "")
            counts[key] = counts.get(key, 0) + 1
        for (status, reason), n in counts.items():
            self.store_decisions.labels(status, reason).inc(n)

    def render(self, stats: specs.Stats, tiers: list[specs.TierUsage], workers: list[specs.WorkerInfo],
               now: float | None = None) -> bytes:
        """This replica's series, and the cluster's when it leads (`stats.leader`)."""
        now = time.time() if now is None else now
        with self._render:  # two scrapes at once must not see each other's half-set series
            self.leader.set(1 if stats.leader else 0)
            self.follower_lag.set(stats.follower_lag_s)
            if not stats.leader:
                return generate_latest(self.registry)
            for name, gauge in self.gauges.items():
                gauge.set(getattr(stats, name))
            self.replicas_by_tier.clear()  # a tier whose last replica went shows no stale count
            for kind, count in stats.replicas_by_tier.items():
                self.replicas_by_tier.labels(kind).set(count)
            for gauge in self._by_worker:
                gauge.clear()
            states: dict[str, int] = {}
            for worker in workers:
                states[worker.state] = states.get(worker.state, 0) + 1
                if worker.state != "dead":
                    self.heartbeat_age.labels(worker.name).set(max(0.0, now - worker.last_heartbeat))
            for state in ("active", "draining", "drained", "dead"):
                self.workers.labels(state).set(states.get(state, 0))
            live = {w.name for w in workers if w.state != "dead"}
            for tier in tiers:
                if tier.worker not in live:
                    continue
                labels = (tier.worker, tier.kind)
                self.tier_used.labels(*labels).set(tier.used_bytes)
                self.tier_blocks.labels(*labels).set(tier.num_blocks)
                self.tier_kv.labels(*labels).set(tier.kv_bytes)
                self.tier_block_bytes.labels(*labels).set(tier.block_bytes)
                if tier.capacity_bytes is not None:  # S3 has no capacity and no watermarks
                    self.tier_capacity.labels(*labels).set(tier.capacity_bytes)
                    self.tier_high.labels(*labels).set(tier.high_watermark)
                    self.tier_low.labels(*labels).set(tier.low_watermark)
            return generate_latest(self.registry) + generate_latest(self.cluster)
