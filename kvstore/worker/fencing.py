"""Which moves this worker is writing under, and which it must never start: how a directory learns
that nothing writes a move's destination any more, without waiting for the move's deadline.

    fence.begin(tokens) -> bool     # a move request starts; False: one of its tokens is fenced (refuse it)
    fence.stuck(tokens, transfer)   # a NIXL request of that move did not finish: it may still write
    fence.end(tokens)               # the move answered
    fence.fence(tokens) -> [bool]   # the directory asks (a new leader, or one that got no answer):
                                    # True when nothing writes under that token here, nor ever will
    fence.quiesce(timeout_s) -> bool   # before the worker joins again under a new epoch: every move
                                       # has ended and nothing NIXL posted still runs

A directory that lost a move's answer (its leader died, or the call timed out) would otherwise
hold the destination's pages until the move's deadline, minutes by default. A token is settled
when no move request under it is running and every NIXL request of it that timed out while posted
(which cannot be aborted) has since been reported finished by NIXL; from then on a request under
it is refused, so a copy the dead leader sent and that arrives late never starts. Fenced tokens
are remembered for KEEP_S, longer than any move's deadline (a directory allows at most an hour);
a stuck token until NIXL is done with its requests.
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
        self._stuck: dict[str, list] = {}  # token -> its transfers NIXL may still be running
        self._fenced: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)

    def begin(self, tokens: set[str]) -> bool:
        with self._lock:
            if any(t in self._fenced for t in tokens):
                return False
            self._running.update(tokens)
            return True

    def stuck(self, tokens: set[str], transfer) -> None:
        """`transfer` (its `settled()` says when NIXL is done with it) may still write under `tokens`."""
        with self._lock:
            for token in tokens:
                self._stuck.setdefault(token, []).append(transfer)

    def end(self, tokens: set[str]) -> None:
        with self._lock:
            self._running.subtract(tokens)
            self._running += Counter()  # drops the zero counts
            self._ended.notify_all()

    def quiesce(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every running move to end; True if none runs and nothing stuck
        may still write."""
        with self._lock:
            self._ended.wait_for(lambda: not self._running, timeout_s)
            return not self._running and not [t for t in list(self._stuck) if not self._settled(t)]

    def _settled(self, token: str) -> bool:
        """Whether a stuck token's transfers are all done now (then it is stuck no more)."""
        if token in self._stuck and all(t.settled() for t in self._stuck[token]):
            del self._stuck[token]
        return token not in self._stuck

    def fence(self, tokens: list[str]) -> list[bool]:
        with self._lock:
            self._forget(self._clock())
            settled = []
            for token in tokens:
                busy = token in self._running or not self._settled(token)
                if not busy:
                    self._fenced[token] = self._clock()
                    self._fenced.move_to_end(token)
                settled.append(not busy)
            while len(self._fenced) > MAX_REMEMBERED:
                self._fenced.popitem(last=False)
            return settled

    def _forget(self, now: float) -> None:
        while self._fenced and now - next(iter(self._fenced.values())) > KEEP_S:
            self._fenced.popitem(last=False)
