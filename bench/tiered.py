"""The multi-tier mode of bench/hit_ratio.py: DRAM over NVMe over S3, as the directory runs them.

Per request: its prefix is looked up across the tiers (a block is served by the fastest tier
holding it); blocks served from NVMe or S3 are staged into DRAM (promotion; the lower copy
stays); the request's admitted misses are placed in DRAM. A full tier evicts its policy's
victim one tier down if the lower tier does not hold it yet and the lower tier's admission
keeps it; the bottom tier drops it. The cost of a hit is the block's bytes over the tier's read
rate, plus the DRAM read for staged blocks (rates from docs/benchmarks.md by default); a
block that misses costs a prefill of `prefill_ms` instead, and so does a hit on a tier slower
than that (an engine recomputes rather than wait). KV time per request = both.
"""

from __future__ import annotations

from kvstore.policies.admission import Admit, Always
from kvstore.policies.hints import NONE, Hints

TIERS = ("dram", "nvme", "s3")


class Hierarchy:
    def __init__(self, evictions: list, admissions: list, capacities: list[int]) -> None:
        self.tiers, self.admissions, self.capacities = evictions, admissions, capacities
        self.parent: dict = {}
        self.hints: dict = {}  # key -> what its save said (its tail mark included)

    def where(self, key) -> int | None:
        return next((i for i, tier in enumerate(self.tiers) if key in tier), None)

    def place(self, level: int, key, protected: set) -> bool:
        tier = self.tiers[level]
        while len(tier) >= self.capacities[level]:
            victims = tier.evict(1, protected if level == 0 else ())
            if victims is None:
                return False
            self.demote(level + 1, victims[0])
        tier.insert(key, self.parent.get(key), self.hints.get(key))
        return True

    def demote(self, level: int, key) -> None:
        if level >= len(self.tiers) or key in self.tiers[level]:
            return  # the bottom drops it; a lower copy exists already
        if isinstance(self.admissions[level].admit(key, 0, self.hints.get(key)), Admit):
            self.place(level, key, set())


def simulate_tiers(hierarchy: Hierarchy, requests: list[list[int]], cost_ms: list[float], prefill_ms: float,
                   hints: list[Hints | None] | None = None) -> dict:
    served = [0] * len(hierarchy.tiers)
    load_ms = 0.0
    prefix = total = 0
    for number, request in enumerate(requests):
        total += len(request)
        said = (hints[number] if hints is not None else None) or NONE
        for i, key in enumerate(request[1:], 1):
            hierarchy.parent.setdefault(key, request[i - 1])
        levels = []
        for key in request:
            level = hierarchy.where(key)
            if level is None:
                break
            levels.append(level)
        prefix += len(levels)
        for level in levels:
            served[level] += 1
            load_ms += min(cost_ms[level], prefill_ms)
        protected = set(request)
        for key, level in reversed(list(zip(request, levels))):  # deepest first, as the directory does
            hierarchy.tiers[level].touch(key)
            hierarchy.admissions[level].record(key)
        for key, level in zip(request, levels):
            if level > 0 and key not in hierarchy.tiers[0]:
                hierarchy.place(0, key, protected)  # promotion into DRAM
        refused = False  # as the directory: every new block is a sighting; none after a refusal is placed
        for i, key in enumerate(request[len(levels):], len(levels)):
            if hierarchy.where(key) is not None:
                continue
            hierarchy.hints[key] = said.as_tail(i == len(request) - 1)
            admitted = isinstance(hierarchy.admissions[0].admit(key, 0, hierarchy.hints[key]), Admit)
            refused = refused or not admitted or not hierarchy.place(0, key, protected)
    return {"prefix_hit_ratio": prefix / total, "load_ms_per_request": load_ms / len(requests),
            "kv_ms_per_request": (load_ms + (total - prefix) * prefill_ms) / len(requests),
            "served": {TIERS[i]: served[i] / total for i in range(len(served))}}


def costs(block_bytes: int, gbps: dict[str, float]) -> list[float]:
    """ms per block served by each tier; NVMe and S3 blocks also cross DRAM."""
    read = [block_bytes / (gbps[t] * 1e9) * 1e3 for t in TIERS]
    return [read[0], read[1] + read[0], read[2] + read[0]]


def build(make_eviction, make_admission, capacities: list[int]) -> Hierarchy:
    """As the directory's defaults: the admission guards DRAM; NVMe and S3 keep what is demoted."""
    admissions = [make_admission(capacities[0]) if make_admission else Always()] + [Always()] * (len(capacities) - 1)
    return Hierarchy([make_eviction(c) for c in capacities], admissions, capacities)
