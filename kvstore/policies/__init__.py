"""Eviction policies (DESIGN §4): pure objects, no I/O, no clock, no DB. See `base.py` for the
contract every policy meets; `make_eviction(name, capacity)` builds one by name.

The directory's demotion still orders victims by SQL (least recently used, deepest first on
ties); wiring these objects into it, and admission policies, come with the policy issue.
"""

from __future__ import annotations

from kvstore.core.errors import KVStoreError
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru import LRU
from kvstore.policies.prefix_lru import PrefixLRU
from kvstore.policies.s3fifo import S3FIFO

EVICTION = {
    "lru": lambda capacity: LRU(),
    "s3fifo": S3FIFO,
    "prefix-lru": lambda capacity: PrefixLRU(),
}


def make_eviction(name: str, capacity: int) -> EvictionPolicy:
    if name not in EVICTION:
        raise KVStoreError("invalid", f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION)}")
    return EVICTION[name](capacity)


__all__ = ["EVICTION", "EvictionPolicy", "LRU", "PrefixLRU", "S3FIFO", "make_eviction"]
