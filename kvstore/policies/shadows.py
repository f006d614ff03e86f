"""Small shadow caches on a spatial sample of the keys, for set dueling (Qureshi et al. ISCA'07;
sampling as in SHARDS, Waldspurger et al. FAST'15): two variants of a policy run on the same
sampled accesses, and the real one follows whichever hits more.

    rate = shadow_rate(capacity)   # keys whose key_hash is below rate * 2^64 feed the shadows
    shadow = Shadow(round(capacity * rate), hot_share, door)   # LRU; with a hot share, SLRU; with a
                                                               # door (an admission), behind it
    shadow.access(key); shadow.score                           # hits, decayed by the caller
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvstore.policies.admission import Admit

MIN_SHADOW = 256  # sampled slots per shadow: below this the sample is too noisy
MIN_RATE = 1 / 64


def shadow_rate(capacity: int) -> float:
    return min(1.0, max(MIN_RATE, MIN_SHADOW / capacity))


class Shadow:
    """An LRU of `capacity` keys; with `hot_share`, keys read twice after they were stored go to a
    protected segment of at most that share (evicted last), as the session-aware LRU promotes them
    (a shadow that promoted on the first read would vote for a hot segment the tier does not run);
    with `door`, a key is stored only if it admits it."""

    def __init__(self, capacity: int, hot_share: float = 0.0, door=None) -> None:
        self.capacity, self.hot_share, self.door = capacity, hot_share, door
        self._probation: OrderedDict = OrderedDict()
        self._hot: OrderedDict = OrderedDict()
        self.score = 0.0

    def access(self, key: Hashable) -> None:
        if key in self._hot:
            self._hot.move_to_end(key)
            self.score += 1
            return
        if key in self._probation:
            self.score += 1
            if self.hot_share and self._probation[key]:  # read twice, as the session-aware LRU counts
                del self._probation[key]
                self._hot[key] = None
                while len(self._hot) > self.hot_share * self.capacity:
                    self._probation[self._hot.popitem(last=False)[0]] = True
            else:
                self._probation[key] = True
                self._probation.move_to_end(key)
            return
        if self.door is not None and not isinstance(self.door.admit(key), Admit):
            return
        self._probation[key] = False
        while len(self._probation) + len(self._hot) > self.capacity:
            (self._probation if self._probation else self._hot).popitem(last=False)
