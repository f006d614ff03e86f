"""The eviction policy contract. Pure objects: no I/O, no clock, no DB, no logging.

Calls, in the order a key lives through them:
    insert(key, parent, hints) # the caller guarantees: key not present; parent None or any key;
                               # hints (`hints.py`) None or what the save said: a policy may ignore them
    touch(key)                 # the caller guarantees: key present (a hit)
    evict(n, protected)        # n victims not in `protected`, removed, or None and nothing changed
    remove(key)                # dropped for another reason (invalidated, deleted); absent keys are ignored
    order(n, protected)        # optional: the keys the next evict(n, protected) would name, nothing changed

A policy MUST hold exactly the keys inserted and not yet evicted or removed
(no phantom, no lost keys), MUST NOT return a protected key, and `evict` MUST
be atomic. The capacity is the caller's: it calls `evict` before inserting
into a full tier. Prefix structure comes in through `parent`: a block whose
parent is gone is useless, so policies may prefer to evict suffixes first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Protocol

from kvstore.policies.hints import Hints


class EvictionPolicy(Protocol):
    def insert(self, key: Hashable, parent: Hashable | None = None, hints: Hints | None = None) -> None: ...

    def touch(self, key: Hashable) -> None: ...

    def evict(self, n: int, protected: Iterable[Hashable] = ()) -> list | None: ...

    def remove(self, key: Hashable) -> None: ...

    def __contains__(self, key: Hashable) -> bool: ...

    def __iter__(self) -> Iterator[Hashable]: ...  # the keys held, in no particular order

    def __len__(self) -> int: ...
