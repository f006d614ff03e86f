"""How often blocks of each class (a hint signature) are read again, learned online on a sample.

    sampled(key_hash(key)) -> bool        # 1 key in SAMPLE, by a stable hash: the measurement
    classes.inserted(key, sig)            # a sampled key was stored under `sig`
    classes.hit(key)                      # ... was read (its first read counts)
    classes.gone(key)                     # ... left without a read
    classes.level(sig) -> 0..MAX_LEVEL    # 0: reused like the best class; k: about 2^k times less
    classes.better(sig) -> bool           # reused at least BETTER times the average

With `limit`, a sampled key not read by the time `limit` newer ones were stored counts as gone
(for an admission condition, which never sees an eviction).

A policy keeps sampled keys as it keeps its best class, so a class it keeps badly cannot look
bad because it is kept badly; with random hints every class is reused alike and all are level 0.
Counts halve every DECAY outcomes, so the classes follow the workload. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable


SAMPLE = 16
DECAY = 20_000
MIN_OUTCOMES = 20  # a class with fewer is level 0: not enough evidence to keep it badly
MAX_LEVEL = 4
BETTER = 1.5
RECOMPUTE = 32  # levels are worked out again after this many outcomes


def sampled(h: int) -> bool:
    """Whether a key whose `key_hash` is `h` measures its class."""
    return h % SAMPLE == 0


class ReuseClasses:
    def __init__(self, limit: int | None = None) -> None:
        self._pending: OrderedDict[Hashable, tuple] = OrderedDict()  # sampled key -> its class, until read or gone
        self._limit = limit
        self._stats: dict[tuple, list[float]] = {}  # class -> [reads, outcomes]
        self._outcomes = 0
        self._levels: dict[tuple, tuple[int, bool]] = {}  # class -> (level, better), until RECOMPUTE

    def inserted(self, key: Hashable, sig: tuple) -> None:
        self._pending[key] = sig
        if self._limit is not None and len(self._pending) > self._limit:
            self._count(self._pending.popitem(last=False)[1], 0.0)

    def hit(self, key: Hashable) -> None:
        sig = self._pending.pop(key, None)
        if sig is not None:
            self._count(sig, 1.0)

    def gone(self, key: Hashable) -> None:
        sig = self._pending.pop(key, None)
        if sig is not None:
            self._count(sig, 0.0)

    def _count(self, sig: tuple, read: float) -> None:
        stats = self._stats.setdefault(sig, [0.0, 0.0])
        stats[0] += read
        stats[1] += 1
        self._outcomes += 1
        if self._outcomes % RECOMPUTE == 0:
            self._levels.clear()
        if self._outcomes >= DECAY:
            self._outcomes = 0
            for s in self._stats.values():
                s[0], s[1] = s[0] / 2, s[1] / 2

    def _rate(self, stats: list[float]) -> float:
        return (stats[0] + 1) / (stats[1] + 2)

    def level(self, sig: tuple) -> int:
        return (self._levels.get(sig) or self._work_out(sig))[0]

    def better(self, sig: tuple) -> bool:
        return (self._levels.get(sig) or self._work_out(sig))[1]

    def _work_out(self, sig: tuple) -> tuple[int, bool]:
        stats = self._stats.get(sig)
        if stats is None or stats[1] < MIN_OUTCOMES:
            found = (0, False)
        else:
            best = max(self._rate(s) for s in self._stats.values() if s[1] >= MIN_OUTCOMES)
            reads, outcomes = sum(s[0] for s in self._stats.values()), sum(s[1] for s in self._stats.values())
            found = (max(0, min(MAX_LEVEL, round(math.log2(best / self._rate(stats))))),
                     self._rate(stats) >= BETTER * (reads + 1) / (outcomes + 2))
        self._levels[sig] = found
        return found

    def __len__(self) -> int:
        return len(self._pending)
