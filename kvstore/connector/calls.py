"""What every call of the engine-side client shares: the directory's refusals made misses, a
completion refused as stale, request hints checked, byte groups, and the time of each phase.

    with miss_if_refused("load", skipped): ...     # "unreachable" / "throttled" -> a miss, counted
    accepted(directory.complete_load, body) -> bool  # False: refused as stale (409)
    request_hints(dict | RequestHints | None)        # a bad one: KVStoreError("invalid")
    groups(sizes, group_bytes) -> [range, ...]        # consecutive items of about group_bytes
    clock = PhaseClock(); clock.timed("prepare", fn, *args); clock.finish()
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager

from prometheus_client import Counter as PromCounter

from kvstore.core import specs
from kvstore.core.errors import KVStoreError

log = logging.getLogger(__name__)


SKIPPED = PromCounter("kvstore_connector_skipped_total", "calls an engine's client made a miss (lookup, load) or "
                      "skipped (save, hand-off commit) because the directory could not answer or throttled them",
                      ["call", "reason"])
SKIP_REASONS = {"unavailable": "unreachable", "throttled": "throttled"}  # error kind -> reason label


@contextmanager
def miss_if_refused(what: str, skipped: Counter):
    """The cache is optional: with the directory unreachable or over the token's rate, an engine
    computes instead (a miss, a save skipped), counted in `skipped` and the metric."""
    try:
        yield
    except KVStoreError as exc:
        reason = SKIP_REASONS.get(exc.kind)
        if reason is None:
            raise
        skipped[(what, reason)] += 1
        SKIPPED.labels(what, reason).inc()
        log.warning("%s skipped (%s): %s", what, reason, exc)


def request_hints(hints: specs.RequestHints | dict | None) -> specs.RequestHints | None:
    """Hints as the wire takes them; a bad one is the caller's error (KVStoreError "invalid")."""
    if hints is None or isinstance(hints, specs.RequestHints):
        return hints
    try:
        return specs.RequestHints.model_validate(hints)
    except ValueError as exc:
        raise KVStoreError("invalid", f"hints: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}",
                           hints=str(hints)[:200]) from None


def accepted(complete, body) -> bool:
    """Run a complete_* call; False when the directory refused it as stale (409), e.g. an expired token.
    A completion the directory says it already committed (a retry, on another directory URL, of a call
    whose answer was lost) is accepted."""
    try:
        complete(body)
        return True
    except KVStoreError as exc:
        if exc.kind != "conflict":
            raise
        if exc.context.get("completed"):
            return True
        log.warning("%s refused: %s", type(body).__name__, exc)
        return False


def groups(sizes: list[int], group_bytes: int) -> list[range]:
    """Consecutive index ranges of about `group_bytes` each (at least one item per range)."""
    groups, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= group_bytes:
            groups.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        groups.append(range(start, len(sizes)))
    return groups


class PhaseClock:
    """Seconds spent per phase of one call, plus its wall time."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._start = time.perf_counter()

    def timed(self, phase: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.laps[phase] = self.laps.get(phase, 0.0) + time.perf_counter() - t0

    def finish(self) -> dict[str, float]:
        return {**self.laps, "wall": time.perf_counter() - self._start}

