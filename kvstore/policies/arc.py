"""ARC (Megiddo & Modha, FAST'03): a recency list T1 (seen once) and a frequency list T2 (seen
again), with ghost lists B1/B2 of what each recently evicted. A hit in B1 means T1 was too
small, a hit in B2 that T2 was; the target size `p` of T1 follows. Here a ghost "hit" is an
`insert` of a key still remembered in B1 or B2 (the caller saves it again after a miss).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict


class ARC:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "ARC needs a capacity"
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict = OrderedDict()
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()
        self._b2: OrderedDict = OrderedDict()

    def insert(self, key, parent=None, hints=None) -> None:
        assert key not in self, "insert of a present key"
        if key in self._b1:
            self.p = min(self.capacity, self.p + max(len(self._b2) / len(self._b1), 1))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        while self._b1 and len(self._b1) + len(self._t1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            self._b2.popitem(last=False)

    def touch(self, key) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]
        self._t2[key] = None

    def evict(self, n: int, protected=()) -> list | None:
        protected = set(protected)
        if len(self) - sum(1 for key in protected if key in self) < n:
            return None
        victims = []
        for _ in range(n):
            prefer_t1 = self._t1 and (len(self._t1) > self.p or not self._t2)
            lists = [(self._t1, self._b1), (self._t2, self._b2)]
            for live, ghost in lists if prefer_t1 else lists[::-1]:
                key = next((k for k in live if k not in protected), None)
                if key is not None:
                    del live[key]
                    ghost[key] = None
                    victims.append(key)
                    break
        return victims

    def remove(self, key) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def __contains__(self, key) -> bool:
        return key in self._t1 or key in self._t2

    def __iter__(self):
        return itertools.chain(list(self._t1), list(self._t2))

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
