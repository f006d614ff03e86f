"""Hinted admission: a block of a class that is read again clearly more than the average (hints say
the conversation goes on) is stored at once; any other block passes the adaptive doorkeeper.

    admit(key, nbytes, hints) -> Admit | Reject     # a sighting of `key` either way
    record(key)                                      # a hit

A doorkeeper makes a block wait for its second sighting, and so costs every reused block its
first reuse; for blocks known to be read again that cost buys nothing. Reuse per class is learned
as in the session-aware LRU (`classes.py`), from a sample of the keys, admitted whatever their
class so that their hits measure it, so random or wrong hints make no class better and the
doorkeeper decides alone.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstore.policies.adaptive import AdaptiveDoorkeeper
from kvstore.policies.admission import ADMIT, Decision
from kvstore.policies.classes import SAMPLE, ReuseClasses, sampled
from kvstore.policies.hints import Hints, signature
from kvstore.policies.tinylfu import key_hash


class HintedAdmission:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "a hinted admission needs a capacity"
        self.doorkeeper = AdaptiveDoorkeeper(capacity)
        self.classes = ReuseClasses(limit=max(1, capacity // SAMPLE))  # the sampled keys the tier holds

    def admit(self, key: Hashable, nbytes: int = 0, hints: Hints | None = None) -> Decision:
        sig = signature(hints)
        h = key_hash(key)
        decision = self.doorkeeper.admit_hashed(key, h)  # a sighting, whatever is decided
        if sampled(h):  # the measurement: admitted whatever its class, to see if it is read again
            self.classes.inserted(key, sig)
            return ADMIT
        if decision is not ADMIT and self.classes.better(sig):
            decision = ADMIT
        return decision

    def record(self, key: Hashable) -> None:
        self.classes.hit(key)
        self.doorkeeper.record(key)
