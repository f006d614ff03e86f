"""Which moves this worker is writing under, and which it must never start: how a directory learns
that nothing writes a move's destination any more, without waiting for the move's deadline.

    fence.begin(tokens) -> bool     # a move request starts; False: one of its tokens is fenced (refuse it)
    fence.stuck(tokens)             # a NIXL request of that move did not finish: it may still write
    fence.end(tokens)               # the move answered
    fence.fence(tokens) -> [bool]   # the directory asks (a new leader, or one that got no answer):
                                    # True when nothing writes under that token here, nor ever will

A directory that lost a move's answer (its leader died, or the call timed out) would otherwise
hold the destination's pages until the move's deadline, minutes by default. A token is settled
when no move request under it is running and none that timed out in NIXL may still write (a
posted request cannot be aborted); from then on a request under it is refused, so a copy the
dead leader sent and that arrives late never starts. Fenced and stuck tokens are remembered for
KEEP_S, longer than any move's deadline (a directory allows at most an hour).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

KEEP_S = 2 * 3600.0
MAX_REMEMBERED = 1 << 20  # fenced tokens; the oldest are forgotten first


class MoveFence:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._running: Counter = Counter()
        self._stuck: OrderedDict[str, float] = OrderedDict()  # token -> when it was marked
        self._fenced: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def begin(self, tokens: set[str]) -> bool:
        with self._lock:
            if any(t in self._fenced for t in tokens):
                return False
            self._running.update(tokens)
            return True

    def stuck(self, tokens: set[str]) -> None:
        with self._lock:
            for token in tokens:
                self._stuck[token] = self._clock()
                self._stuck.move_to_end(token)

    def end(self, tokens: set[str]) -> None:
        with self._lock:
            self._running.subtract(tokens)
            self._running += Counter()  # drops the zero counts

    def fence(self, tokens: list[str]) -> list[bool]:
        with self._lock:
            self._forget(self._clock())
            settled = []
            for token in tokens:
                busy = token in self._running or token in self._stuck
                if not busy:
                    self._fenced[token] = self._clock()
                    self._fenced.move_to_end(token)
                settled.append(not busy)
            while len(self._fenced) > MAX_REMEMBERED:
                self._fenced.popitem(last=False)
            return settled

    def _forget(self, now: float) -> None:
        for remembered in (self._fenced, self._stuck):
            while remembered and now - next(iter(remembered.values())) > KEEP_S:
                remembered.popitem(last=False)
