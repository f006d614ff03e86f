"""Eviction and admission policies: pure objects, no I/O, no clock, no DB.

    make_eviction(name, capacity)   # see `base.py` for the contract every eviction policy meets
    make_admission(spec, capacity)  # "adaptive", "doorkeeper,backpressure", "size:4KiB-64MiB,tinylfu"

The directory runs one eviction and one admission object per tier (`directory/tier_policies.py`);
`bench/hit_ratio.py` drives the same objects. DEFAULT_EVICTION + DEFAULT_ADMISSION is what the
directory runs out of the box.
"""

from __future__ import annotations

from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import parse_size
from kvstore.policies.adaptive import AdaptiveDoorkeeper
from kvstore.policies.admission import (Admit, AdmissionChain, Always, Backpressure, Doorkeeper, Reject, SizeRange,
                                        Throttled)
from kvstore.policies.arc import ARC
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.hinted import HintedAdmission
from kvstore.policies.hints import Hints
from kvstore.policies.lru import LRU
from kvstore.policies.prefix_lru import PrefixLRU
from kvstore.policies.s3fifo import S3FIFO
from kvstore.policies.session import SessionLRU
from kvstore.policies.tinylfu import TinyLFU

EVICTION = {
    "lru": lambda capacity: LRU(),
    "arc": ARC,
    "s3fifo": S3FIFO,
    "prefix-lru": lambda capacity: PrefixLRU(),
    "session": SessionLRU,
}
ADMISSION = {
    "always": lambda capacity: Always(),
    "doorkeeper": Doorkeeper,
    "adaptive": AdaptiveDoorkeeper,
    "tinylfu": TinyLFU,
    "backpressure": lambda capacity: Backpressure(),
    "session": HintedAdmission,
}
DEFAULT_EVICTION, DEFAULT_ADMISSION = "session", "session"
DEFAULT_ADMISSION_BY_TIER = {"nvme": "always", "s3": "always"}  # capacity tiers keep what is demoted


def make_eviction(name: str, capacity: int) -> EvictionPolicy:
    if name not in EVICTION:
        raise KVStoreError("invalid", f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION)}")
    return EVICTION[name](capacity)


def make_admission(spec: str, capacity: int):
    """One condition by name, `size:MIN-MAX`, or a comma-separated chain of them."""
    conditions = [_condition(part.strip(), capacity) for part in spec.split(",")]
    return conditions[0] if len(conditions) == 1 else AdmissionChain(conditions)


def _condition(name: str, capacity: int):
    if name.startswith("size:"):
        low, _, high = name[5:].partition("-")
        return SizeRange(parse_size(low) if low else 0, parse_size(high) if high else None)
    if name not in ADMISSION:
        raise KVStoreError("invalid", f"unknown admission policy {name!r}; choose from {sorted(ADMISSION)} "
                           "or size:MIN-MAX, joined by commas")
    return ADMISSION[name](max(1, capacity))


__all__ = ["ADMISSION", "ARC", "AdaptiveDoorkeeper", "Admit", "AdmissionChain", "Always", "Backpressure",
           "DEFAULT_ADMISSION", "DEFAULT_ADMISSION_BY_TIER", "DEFAULT_EVICTION", "Doorkeeper", "EVICTION",
           "EvictionPolicy", "HintedAdmission", "Hints", "LRU", "PrefixLRU", "Reject", "S3FIFO", "SessionLRU",
           "SizeRange", "Throttled", "TinyLFU", "make_admission", "make_eviction"]
