"""Tier-sized work gives way to the hot calls while they come.

    pace.served()                 # the event loop, after each hot call it answered
    with pace.tier_sized():       # a thread's tier-sized job (a policy's build, a large save's decision)
        for row in pace.paced(rows):  # rests now and then while calls come
            ...

The directory answers lookups on its event loop; tier-sized work (a tier's policy built from SQL, a
dry-run eviction, the decision of a save of thousands of blocks) runs on other threads of the same
process. Python lets one thread run at a time, and a thread that computes without pause takes that
turn back every switch interval: each time the loop gives it up (for every system call that reads
or writes a socket) it waits for it again, several times per lookup. Beside an event loop that
answers small requests, a thread computing in Python put their p99 at 6x its quiet figure, the
same work in another process left it where it was, and the thread paced as below, 2.5x
(`bench/pacing.py`).

`paced` makes such a loop rest REST_S after every WORK_S of work while the event loop has answered
a call within the last RECENT_S, so the loop mostly finds the interpreter free. It rests only inside
`tier_sized()` on its thread: the same loops serve small saves, decided on a thread when the loop
finds a lock taken, and resting there cost saves up to a third of their rate. With nobody
calling it costs a clock read every CHECK_EVERY items. It never rests on an event loop's own
thread, and it holds no lock of its own: a caller that paces under one holds that lock longer while
calls come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

WORK_S = 0.0002  # of work between two rests
REST_S = 0.0002  # a rest: the interpreter is the event loop's meanwhile
RECENT_S = 0.01  # calls answered within this long ago: more are coming
CHECK_EVERY = 16  # items between two reads of the clock

T = TypeVar("T")
_last_served = float("-inf")  # time.perf_counter() when the event loop last answered a hot call
_loop_threads: set[int] = set()  # the threads that answer them (an event loop each)
_job = threading.local()  # .on: this thread is doing tier-sized work


def served() -> None:
    """The event loop answered a hot call (called on its thread)."""
    global _last_served
    _last_served = time.perf_counter()
    _loop_threads.add(threading.get_ident())


def calls_coming(now: float | None = None) -> bool:
    return (time.perf_counter() if now is None else now) - _last_served < RECENT_S


@contextmanager
def tier_sized(really: bool = True):
    """The `paced` loops this thread runs meanwhile rest while calls come (unless not `really`)."""
    was = getattr(_job, "on", False)
    _job.on = was or really
    try:
        yield
    finally:
        _job.on = was


def paced(items: Iterable[T], every: int = CHECK_EVERY) -> Iterable[T]:
    """`items`, with a rest of REST_S after each WORK_S spent between them while calls come, inside
    `tier_sized()`; outside it `items` themselves (a small save's steps pay nothing)."""
    if not getattr(_job, "on", False) or threading.get_ident() in _loop_threads:
        return items
    return _resting(items, every)


def _resting(items: Iterable[T], every: int) -> Iterator[T]:
    clock, began = time.perf_counter, time.perf_counter()
    for i, item in enumerate(items):
        if i % every == 0:
            now = clock()
            if now - began >= WORK_S:
                if calls_coming(now):
                    time.sleep(REST_S)
                    now = clock()
                began = now
        yield item
