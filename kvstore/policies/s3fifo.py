"""S3-FIFO (Yang et al., SOSP'23): a small FIFO for new keys, a main FIFO for keys seen again,
and a ghost FIFO remembering recently evicted keys. Frequencies are capped at 3."""

from __future__ import annotations

import itertools
from collections import OrderedDict

SMALL_FRACTION = 0.1


class S3FIFO:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "S3-FIFO needs a capacity"
        self.capacity = capacity
        self._small: OrderedDict = OrderedDict()  # key -> freq
        self._main: OrderedDict = OrderedDict()
        self._ghost: OrderedDict = OrderedDict()

    def insert(self, key, parent=None, hints=None) -> None:
        assert key not in self, "insert of a present key"
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def touch(self, key) -> None:
        queue = self._small if key in self._small else self._main
        queue[key] = min(queue[key] + 1, 3)

    def evict(self, n: int, protected=()) -> list | None:
        protected = set(protected)
        if len(self) - sum(1 for key in protected if key in self) < n:
            return None
        victims = []
        while len(victims) < n:
            victims.append(self._evict_one(protected))
        return victims

    def _evict_one(self, protected: set):
        small_target = max(1, int(self.capacity * SMALL_FRACTION))
        stuck_small = stuck_main = 0  # consecutive protected keys seen at the head of each queue
        for _ in range(5 * (len(self._small) + len(self._main)) + 5):
            main_stuck = stuck_main >= len(self._main)  # main holds only protected keys: small must give
            use_small = self._small and stuck_small < len(self._small) and \
                (len(self._small) >= small_target or main_stuck)
            if use_small:
                key, freq = self._small.popitem(last=False)
                if key in protected:
                    self._small[key] = freq
                    stuck_small += 1
                elif freq > 0:
                    self._main[key] = 0  # seen again while small: promote
                    stuck_main = 0
                else:
                    self._remember(key)
                    return key
            elif not main_stuck:
                key, freq = self._main.popitem(last=False)
                if key in protected:
                    self._main[key] = freq
                    stuck_main += 1
                elif freq > 0:
                    self._main[key] = freq - 1
                    stuck_main = 0
                else:
                    return key
            else:
                stuck_small = stuck_main = 0
        raise AssertionError("no evictable key although enough were unprotected")

    def _remember(self, key) -> None:
        self._ghost[key] = None
        while len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)

    def remove(self, key) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)

    def __contains__(self, key) -> bool:
        return key in self._small or key in self._main

    def __iter__(self):
        return itertools.chain(list(self._small), list(self._main))

    def __len__(self) -> int:
        return len(self._small) + len(self._main)
