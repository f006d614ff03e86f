"""Admission: whether a block earns a place at all. Pure values, no I/O, no clock.

    decision = condition.admit(key)      # Admit / Reject / Throttled(retry_after_s)
    chain = AdmissionChain([a, b, ...])  # the first non-Admit answer wins

Doorkeeper: a key is admitted on its second sighting within a window of
`WINDOW` x capacity distinct keys (the set of sightings is cleared when full,
which also ages it), so blocks seen once never displace others.
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


class Always:
    def admit(self, key: Hashable) -> Decision:
        return ADMIT


class Doorkeeper:
    WINDOW = 8  # remember this many times the tier's capacity in keys

    def __init__(self, capacity: int, window: int | None = None) -> None:
        assert capacity > 0, "a doorkeeper needs a capacity"
        self.capacity = capacity * (window or self.WINDOW)
        self._seen: set = set()

    def admit(self, key: Hashable) -> Decision:
        if key in self._seen:
            return ADMIT
        if len(self._seen) >= self.capacity:
            self._seen.clear()
        self._seen.add(key)
        return Reject("first sighting")


class AdmissionChain:
    def __init__(self, conditions: Iterable) -> None:
        self.conditions = list(conditions)

    def admit(self, key: Hashable) -> Decision:
        for condition in self.conditions:
            decision = condition.admit(key)
            if not isinstance(decision, Admit):
                return decision
        return ADMIT


ADMISSION = {"always": lambda capacity: Always(), "doorkeeper": Doorkeeper}
