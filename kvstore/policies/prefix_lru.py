"""Prefix-aware LRU: only leaves of the cached prefix tree are evicted, least recently used first.

A block's KV is useful only with all of its prefix, so a block with cached
children is kept until its children are gone: cold chains are cut from the
tail, and a prefix shared by many requests stays while any of its suffixes
does. Among leaves, recency decides. A heap with lazy deletion keeps `evict`
at O(n log n) for n victims.
"""

from __future__ import annotations

import heapq
import itertools


class PrefixLRU:
    def __init__(self) -> None:
        self._stamp: dict = {}  # key -> last use (a counter, not a clock)
        self._parent: dict = {}
        self._children: dict = {}  # key -> number of cached children
        self._leaves: list = []  # heap of (stamp, key); stale entries skipped
        self._clock = itertools.count()

    def insert(self, key, parent=None, hints=None) -> None:
        assert key not in self._stamp, "insert of a present key"
        self._parent[key] = parent if parent in self._stamp else None
        self._children[key] = 0
        if self._parent[key] is not None:
            self._children[self._parent[key]] += 1
        self._use(key)

    def touch(self, key) -> None:
        self._use(key)

    def _use(self, key) -> None:
        self._stamp[key] = next(self._clock)
        if self._children[key] == 0:
            heapq.heappush(self._leaves, (self._stamp[key], key))

    def evict(self, n: int, protected=()) -> list | None:
        protected = set(protected)
        if len(self._stamp) - sum(1 for key in protected if key in self._stamp) < n:
            return None
        victims, held_back = [], []
        while len(victims) < n:
            if not self._leaves:  # only protected leaves remain: take the least recent unprotected key
                victims.append(self._oldest_unprotected(protected))
                self._drop(victims[-1])
                continue
            stamp, key = heapq.heappop(self._leaves)
            if key not in self._stamp or self._stamp[key] != stamp or self._children[key]:
                continue  # stale entry
            if key in protected:
                held_back.append((stamp, key))
                continue
            victims.append(key)
            self._drop(key)
        for entry in held_back:
            heapq.heappush(self._leaves, entry)
        return victims

    def _oldest_unprotected(self, protected: set):
        return min((k for k in self._stamp if k not in protected), key=self._stamp.__getitem__)

    def _drop(self, key) -> None:
        parent = self._parent.pop(key)
        del self._stamp[key]
        children = self._children.pop(key)
        if children:  # removed with children cached: they lose their parent link
            for child, p in self._parent.items():
                if p == key:
                    self._parent[child] = None
        if parent is not None and parent in self._stamp:
            self._children[parent] -= 1
            if self._children[parent] == 0:
                heapq.heappush(self._leaves, (self._stamp[parent], parent))

    def remove(self, key) -> None:
        if key in self._stamp:
            self._drop(key)

    def __contains__(self, key) -> bool:
        return key in self._stamp

    def __iter__(self):
        return iter(list(self._stamp))

    def __len__(self) -> int:
        return len(self._stamp)
