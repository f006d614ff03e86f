"""Admission: whether a block earns a place at all. Pure values, no I/O, no clock.

    decision = condition.admit(key, nbytes, hints)   # on a miss; counts as a sighting of `key`;
                                                     # hints (`hints.py`): None or what the save said
    condition.record(key)                     # on a hit (frequency-based conditions count it)
    chain = AdmissionChain([a, b, ...])       # the first non-Admit answer wins

A decision is Admit, Reject(reason) or Throttled(retry_after_s). Admission decides placement
(a new block) and demotion alike: "keep it one tier down?" is the lower tier's `admit`.

Doorkeeper: admitted on the second sighting within a window of `WINDOW` x capacity distinct
keys (a Bloom filter of sightings, cleared when full, which also ages it), so blocks seen once
rarely displace others. TinyLFU and the adaptive doorkeeper are in `tinylfu.py` and `adaptive.py`.
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
    """Second sightings, remembered in a Bloom filter of `BITS_PER_KEY` bits a key and two probes (two
    parts of `hash(key)`): two bytes a key of the window instead of a set's 64, and never more than
    `MAX_BYTES` whatever the tier's size. A first sighting is admitted by mistake with a chance of at
    most 1.4 % (`(1 - e^(-2/16))^2`, when the filter is full); the filter is cleared after `window`
    keys, or when its bits are full, whichever comes first."""
    WINDOW = 16  # remember this many times the tier's capacity in keys
    BITS_PER_KEY = 16
    MIN_BYTES, MAX_BYTES = 8 << 10, 16 << 20

    def __init__(self, capacity: int, window: int | None = None) -> None:
        assert capacity > 0, "a doorkeeper needs a capacity"
        keys = capacity * (window or self.WINDOW)
        nbytes = 1 << (max(self.MIN_BYTES, min(self.MAX_BYTES, keys * self.BITS_PER_KEY // 8)) - 1).bit_length()
        self.capacity = min(keys, nbytes * 8 // self.BITS_PER_KEY)  # keys remembered before it is cleared
        self._bits = bytearray(nbytes)
        self._mask = nbytes * 8 - 1
        self._keys = 0

    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:
        h = hash(key)  # cached by a str (keys are `namespace/hash` strings): no second pass over the key
        bits, mask = self._bits, self._mask
        a, b = h & mask, (h >> 32) & mask
        if bits[a >> 3] >> (a & 7) & 1 and bits[b >> 3] >> (b & 7) & 1:
            return ADMIT
        if self._keys >= self.capacity:
            self._bits = bits = bytearray(len(bits))
            self._keys = 0
        bits[a >> 3] |= 1 << (a & 7)
        bits[b >> 3] |= 1 << (b & 7)
        self._keys += 1
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
