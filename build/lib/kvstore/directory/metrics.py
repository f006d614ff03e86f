"""Prometheus metrics of the directory (names prefixed `kvstore_`), one registry per app."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvstore.core import specs


class DirectoryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.gauges = {name: Gauge(f"kvstore_{name}", help_, registry=r) for name, help_ in (
            ("blocks", "Blocks in the directory"), ("replicas", "Replicas in any state"),
            ("reservations", "Replicas being written (WRITING)"),
            ("leases_active", "Distinct reader leases"), ("pins", "Replicas pinned by leases"),
            ("workers_active", "Workers in state active"), ("inflight_moves", "Replicas being copied to another tier"))}
        self.replicas_by_tier = Gauge("kvstore_tier_replicas", "Visible replicas per tier kind, all workers", ["tier"], registry=r)
        self.move_failures = Counter("kvstore_move_failures", "Blocks whose move between tiers failed",
                                     ["route"], registry=r)
        self.tier_capacity = Gauge("kvstore_tier_capacity_bytes", "Tier capacity", ["worker", "kind"], registry=r)
        self.tier_used = Gauge("kvstore_tier_used_bytes", "Tier bytes reserved or used",
                               ["worker", "kind"], registry=r)
        self.tier_blocks = Gauge("kvstore_tier_blocks", "Visible replicas per tier", ["worker", "kind"], registry=r)

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

    def render(self, stats: specs.Stats, tiers: list[specs.TierUsage]) -> bytes:
        for name, gauge in self.gauges.items():
            gauge.set(getattr(stats, name))
        for kind, count in stats.replicas_by_tier.items():
            self.replicas_by_tier.labels(kind).set(count)
        for tier in tiers:
            self.tier_capacity.labels(tier.worker, tier.kind).set(tier.capacity_bytes or 0)
            self.tier_used.labels(tier.worker, tier.kind).set(tier.used_bytes)
            self.tier_blocks.labels(tier.worker, tier.kind).set(tier.num_blocks)
        return generate_latest(self.registry)
