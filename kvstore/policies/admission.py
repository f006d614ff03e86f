"""Admission: whether a block earns a place at all. Pure values, no I/O, no clock.

    decision = condition.admit(key, nbytes, hints)   # on a miss; counts as a sighting of `key`;
                                                     # hints (`hints.py`): None or what the save said
    condition.record(key)                     # on a hit (frequency-based conditions count it)
    chain = AdmissionChain([a, b, ...])       # the first non-Admit answer wins

A decision is Admit, Reject(reason) or Throttled(retry_after_s). Admission decides placement
(a new block) and demotion alike: "keep it one tier down?" is the lower tier's `admit`.

Doorkeeper: admitted on the second sighting within a window of `WINDOW` x capacity distinct
keys (the set of sightings is cleared when full, which also ages it), so blocks seen once never
displace others. TinyLFU and the adaptive doorkeeper are in `tinylfu.py` and `adaptive.py`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Reject:
    reason: str


@dataclass(frozen=True)
class Throttled:
    retry_after_s: float


Decision = Admit | Reject | Throttled
ADMIT = Admit()
FIRST_SIGHTING = Reject("first sighting")


class Always:
    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:
        return ADMIT

    def record(self, key: Hashable) -> None:
        pass


class Doorkeeper:
    WINDOW = 16  # remember this many times the tier's capacity in keys

    def __init__(self, capacity: int, window: int | None = None) -> None:
        assert capacity > 0, "a doorkeeper needs a capacity"
        self.capacity = capacity * (window or self.WINDOW)
        self._seen: set[int] = set()  # hash(key): an int, not a key string held per block

    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:
        h = hash(key)
        if h in self._seen:
            return ADMIT
        if len(self._seen) >= self.capacity:
            self._seen.clear()
        self._seen.add(h)
        return FIRST_SIGHTING

    def record(self, key: Hashable) -> None:
        pass  # a hit is in the cache already


class SizeRange:
    """Blocks outside [min_bytes, max_bytes] are not worth a place (e.g. larger than a tier's page run)."""

    def __init__(self, min_bytes: int = 0, max_bytes: int | None = None) -> None:
        self.min_bytes, self.max_bytes = min_bytes, max_bytes

    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:
        if nbytes < self.min_bytes or (self.max_bytes is not None and nbytes > self.max_bytes):
            return Reject(f"size {nbytes} outside [{self.min_bytes}, {self.max_bytes}]")
        return ADMIT

    def record(self, key: Hashable) -> None:
        pass


class Backpressure:
    """Throttle writers while the tier is fuller than `threshold` after eviction had its chance.
    The caller sets `pressure` (used / capacity, 0..1) before asking."""

    def __init__(self, threshold: float = 0.98, retry_after_s: float = 1.0) -> None:
        self.threshold, self.retry_after_s = threshold, retry_after_s
        self.pressure = 0.0

    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:
        return Throttled(self.retry_after_s) if self.pressure >= self.threshold else ADMIT

    def record(self, key: Hashable) -> None:
        pass


class AdmissionChain:
    def __init__(self, conditions: Iterable) -> None:
        self.conditions = list(conditions)

    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:  # cheap, stateless conditions go first
        for condition in self.conditions:
            decision = condition.admit(key, nbytes, hints)
            if not isinstance(decision, Admit):
                return decision
        return ADMIT

    def record(self, key: Hashable) -> None:
        for condition in self.conditions:
            condition.record(key)
