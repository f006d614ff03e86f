"""TinyLFU admission (Einziger et al., TOS'17): a count-min sketch of recent sightings, aged by
halving every counter once `SAMPLE` x capacity sightings have been counted.

    admit(key, nbytes)            -> Admit when the key was seen at least `threshold` times lately
    admit(key, nbytes, victim=v)  -> Admit when the key was seen more often than the victim it would
                                     replace; a key seen at least `FLOOD` times wins a small random
                                     share of ties and losses, so an adversary who keeps residents
                                     hot cannot freeze the cache
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import xxhash

from kvstore.policies.admission import ADMIT, Decision, Reject

MAX_COUNT = 15  # 4-bit counters, as in the paper
DEPTH = 4


def key_hash(key: Hashable) -> int:
    """A stable 64-bit hash (Python's str hash changes per process)."""
    if isinstance(key, int):
        return xxhash.xxh64_intdigest(key.to_bytes(16, "little", signed=True))
    return xxhash.xxh64_intdigest(key if isinstance(key, bytes) else str(key).encode())


class CountMinSketch:
    def __init__(self, width: int) -> None:
        self.mask = (1 << max(6, (width - 1).bit_length())) - 1
        self.rows = [bytearray(self.mask + 1) for _ in range(DEPTH)]

    def _slots(self, key: Hashable) -> list[int]:
        h = key_hash(key)
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [(h1 + i * h2) & self.mask for i in range(DEPTH)]

    def add(self, key: Hashable) -> int:
        slots = self._slots(key)
        count = min(row[s] for row, s in zip(self.rows, slots))
        if count < MAX_COUNT:
            for row, s in zip(self.rows, slots):
                if row[s] == count:  # conservative update: only the minima grow
                    row[s] = count + 1
        return min(count + 1, MAX_COUNT)

    def estimate(self, key: Hashable) -> int:
        return min(row[s] for row, s in zip(self.rows, self._slots(key)))

    def halve(self) -> None:
        for i, row in enumerate(self.rows):
            self.rows[i] = bytearray(c >> 1 for c in row)


class TinyLFU:
    SAMPLE = 10  # age after this many times the capacity in sightings
    FLOOD = 6
    JITTER = 1 / 128

    def __init__(self, capacity: int, threshold: int = 2, seed: int = 0) -> None:
        assert capacity > 0, "TinyLFU needs a capacity"
        self.threshold = threshold
        self.sketch = CountMinSketch(capacity * 2)
        self._sample, self._counted = self.SAMPLE * capacity, 0
        self._random = random.Random(seed)

    def _count(self, key: Hashable) -> int:
        self._counted += 1
        if self._counted >= self._sample:
            self.sketch.halve()
            self._counted //= 2
        return self.sketch.add(key)

    def admit(self, key: Hashable, nbytes: int = 0, hints=None, victim: Hashable | None = None) -> Decision:
        seen = self._count(key)
        if victim is None:
            return ADMIT if seen >= self.threshold else Reject(f"seen {seen} < {self.threshold} times")
        rival = self.sketch.estimate(victim)
        if seen > rival or (seen >= self.FLOOD and self._random.random() < self.JITTER):
            return ADMIT
        return Reject(f"seen {seen} times, the victim {rival}")

    def record(self, key: Hashable) -> None:
        self._count(key)
