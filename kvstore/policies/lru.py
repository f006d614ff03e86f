"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()

    def insert(self, key, parent=None, hints=None) -> None:
        assert key not in self._order, "insert of a present key"
        self._order[key] = None

    def touch(self, key) -> None:
        self._order.move_to_end(key)

    def evict(self, n: int, protected=()) -> list | None:
        protected = set(protected)
        victims = []
        for key in self._order:  # oldest first
            if len(victims) == n:
                break
            if key not in protected:
                victims.append(key)
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def order(self, n: int, protected=()) -> list:
        protected = set(protected)
        return list(islice((key for key in self._order if key not in protected), n))

    def __contains__(self, key) -> bool:
        return key in self._order

    def __iter__(self):
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)
