"""Eviction policies (DESIGN §4): pure objects, no I/O, no clock, no DB. See `base.py` for the
contract every policy meets; `make_eviction(name, capacity)` builds one by name.

The directory's demotion still orders victims by SQL (least recently used, deepest first on
ties) and admits every block; wiring these objects into it comes with the policy issue.
"""

from __future__ import annotations

from kvstore.core.errors import KVStoreError
from kvstore.policies.admission import ADMISSION, Admit, AdmissionChain, Reject, Throttled
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


def make_admission(name: str, capacity: int):
    if name not in ADMISSION:
        raise KVStoreError("invalid", f"unknown admission policy {name!r}; choose one of {sorted(ADMISSION)}")
    return ADMISSION[name](capacity)


__all__ = ["ADMISSION", "Admit", "AdmissionChain", "EVICTION", "EvictionPolicy", "LRU", "PrefixLRU", "Reject",
           "S3FIFO", "Throttled", "make_admission", "make_eviction"]
