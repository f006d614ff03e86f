"""Adaptive doorkeeper: admit everything or only second sightings, whichever is hitting more now.

A doorkeeper helps a small cache (blocks seen once stop pushing out blocks that come back) and
hurts a large one (a block's second use is always a miss). Which regime a tier is in depends on
its size and on the workload, so this condition measures it (set dueling, Qureshi et al.
ISCA'07, on a spatial sample as in SHARDS, Waldspurger et al. FAST'15): keys whose hash falls in
a `rate` sample drive two small shadow LRU caches of `rate` x capacity, one admitting every
block and one behind a doorkeeper. Each shadow counts its hits with exponential decay; the main
tier follows the shadow that hits more (ties: admit everything). The main doorkeeper counts
sightings in both modes, so a switch takes effect at once.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstore.policies.admission import ADMIT, Decision, Doorkeeper
from kvstore.policies.shadows import Shadow, shadow_rate
from kvstore.policies.tinylfu import key_hash

class AdaptiveDoorkeeper:
    def __init__(self, capacity: int, window: int | None = None) -> None:
        assert capacity > 0, "an adaptive doorkeeper needs a capacity"
        self.rate = shadow_rate(capacity)
        self._cut = int(self.rate * (1 << 64))
        shadow = max(1, round(capacity * self.rate))
        self._always = Shadow(shadow)
        self._door = Shadow(shadow, door=Doorkeeper(shadow, window))
        self._decay_every, self._sampled = 4 * shadow, 0
        self.doorkeeper = Doorkeeper(capacity, window)

    @property
    def filtering(self) -> bool:
        """True while the doorkeeper's shadow is hitting more than the admit-all one."""
        return self._door.score > self._always.score

    def _observe(self, key: Hashable, h: int | None = None) -> None:
        if (key_hash(key) if h is None else h) >= self._cut:
            return
        self._always.access(key)
        self._door.access(key)
        self._sampled += 1
        if self._sampled >= self._decay_every:
            self._sampled = 0
            self._always.score /= 2
            self._door.score /= 2

    def admit(self, key: Hashable, nbytes: int = 0, hints=None) -> Decision:
        return self.admit_hashed(key, key_hash(key))

    def admit_hashed(self, key: Hashable, h: int) -> Decision:
        """`admit`, for a caller that has the key's `key_hash` already."""
        self._observe(key, h)
        decision = self.doorkeeper.admit(key)
        return decision if self.filtering else ADMIT

    def record(self, key: Hashable, h: int | None = None) -> None:
        self._observe(key, h)
