"""Each tier's eviction order in a child process, behind `TierPolicies`' calls.

    policies = ChildOrder(eviction, admission, database_url)   # admission stays in this process
    policies.build(tier, read_rows)    # the child builds the tier's order from SQL (read_rows unused)
    policies.evict(tier, n, keep)      # its next victims; None when it ran dry or is not there
    policies.dry_run(tier, limit, keep, to_free) -> (replicas, bytes) | None
    policies.close()

The directory answers lookups on one interpreter; a tier's order built from a million rows, or a dry
run that walks a copy of it, held that interpreter for seconds and lookups waited behind it. Here
that work runs in `order_child.py`, fed by what the lookup index reports after each commit (blocks
that became readable on a tier or left it), by loads' hits and by saves' hints, on a pipe that keeps
their order. The caller of a build, an eviction or a dry run waits on the pipe without the
interpreter.

The child starts the first time a tier's order is needed; until then this process keeps saves'
hints as `TierPolicies` does, and hands them over at the start. Victims it names are re-checked in
SQL by the caller, as the policies' always were. If it ends (or does not answer within
ASK_TIMEOUT_S), evictions take SQL's order (least recently used first) until it is started again,
RESTART_AFTER_S later at the earliest, and builds its orders from SQL anew.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from kvstore.core.pace import paced
from kvstore.directory.moves.order_child import TierSpec, read_frame, write_frame
from kvstore.directory.tier_policies import TierPolicies, record_hits

log = logging.getLogger(__name__)
RESTART_AFTER_S = 30.0  # after the child ended, the next order it is needed for starts it again
ASK_TIMEOUT_S = 600.0  # a build of millions of rows on a slow machine; past it the child is stopped
REPLAY_AT_ONCE = 10_000  # admission counts replayed under one hold of the lock
ENDED = "the eviction order's process is not running"


def spec(tier) -> TierSpec:
    return TierSpec(tier.id, tier.kind, tier.capacity_bytes, tier.page_bytes)


class _Child:
    """One run of the child process: its pipe, a thread that writes to it, one that reads answers."""

    def __init__(self, eviction: dict[str, str], database_url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.directory.moves.order_child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.alive = True
        self._outbox: deque = deque([("start", eviction, database_url)])
        self._answers: dict[int, list] = {}  # request id -> [answered, ok, value]
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        threading.Thread(target=self._send, name="order-send", daemon=True).start()
        threading.Thread(target=self._receive, name="order-receive", daemon=True).start()

    def tell(self, message: tuple) -> None:
        with self._cond:
            if self.alive:
                self._outbox.append(message)
                self._cond.notify()

    def ask(self, kind: str, *args, timeout_s: float = ASK_TIMEOUT_S) -> tuple[bool, object]:
        """(True, the answer) or (False, what went wrong); waits without the interpreter."""
        slot = [threading.Event(), False, ENDED]
        with self._cond:
            if not self.alive:
                return False, ENDED
            request = next(self._ids)
            self._answers[request] = slot
            self._outbox.append((kind, request, *args))
            self._cond.notify()
        if not slot[0].wait(timeout_s):
            self.stop(f"no answer to {kind} within {timeout_s:.0f} s")
            return False, f"no answer within {timeout_s:.0f} s"
        return slot[1], slot[2]

    def _send(self) -> None:
        while True:
            with self._cond:
                while self.alive and not self._outbox:
                    self._cond.wait()
                if not self.alive:
                    return
                batch = list(self._outbox)
                self._outbox.clear()
            try:
                for message in batch:
                    write_frame(self.proc.stdin, message)
            except (OSError, ValueError):  # a closed pipe: the child ended
                self._ended("its input closed")
                return

    def _receive(self) -> None:
        while True:
            try:
                message = read_frame(self.proc.stdout)
            except Exception:  # a torn frame: the child ended mid-answer
                message = None
            if message is None:
                self._ended("its output closed")
                return
            request, ok, value = message
            with self._cond:
                slot = self._answers.pop(request, None)
            if slot is not None:
                slot[1], slot[2] = ok, value
                slot[0].set()

    def _ended(self, why: str, expected: bool = False) -> None:
        with self._cond:
            was, self.alive = self.alive, False
            waiting = list(self._answers.values())
            self._answers.clear()
            self._cond.notify_all()
        for slot in waiting:
            slot[0].set()  # unanswered: (False, ENDED)
        if was and not expected:
            log.error("the eviction order's process ended (%s; exit status %s): evictions take SQL's order "
                      "until it is started again", why, self.proc.poll())

    def stop(self, why: str | None = None) -> None:
        """Ends the child (why: unexpectedly, which is logged)."""
        self._ended(why or "stopped", expected=why is None)
        try:
            self.proc.stdin.close()  # the child ends at the end of its input
            self.proc.wait(timeout=5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class ChildOrder(TierPolicies):
    """`TierPolicies` whose eviction orders live in a child process; admissions stay here."""

    local = False

    def __init__(self, eviction: dict[str, str], admission: dict[str, str], database_url: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(eviction, admission)
        self._url = database_url
        self._clock = clock
        self._child: _Child | None = None
        self._started_at = float("-inf")
        self._built: set[int] = set()  # tiers whose order the running child holds
        self._closed = False

    def _running(self) -> _Child | None:
        child = self._child
        return child if child is not None and child.alive else None

    def _start(self) -> _Child | None:
        """The running child; started if there is none (again RESTART_AFTER_S after one ended), with
        the hints kept here meanwhile. Under `lock`, so no hint or change passes it on the way."""
        if (child := self._running()) is not None:
            return child
        if self._closed or self._clock() - self._started_at < RESTART_AFTER_S:
            return None
        if self._child is not None:
            self._child.stop()
        self._started_at = self._clock()
        self._built.clear()
        try:
            self._child = _Child(self._names[0], self._url)
        except OSError as exc:
            log.error("the eviction order's process could not start (%s): evictions take SQL's order", exc)
            self._child = None
            return None
        self._child.tell(("expected", None, self.take_expected()))
        return self._child

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        child = self._running()
        return child.proc.pid if child is not None else None

    def close(self) -> None:
        with self.lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            child.stop()

    # ---- told: this process's admission, the child's order --------------------------------

    def expect(self, tier, blocks: list) -> None:
        with self.lock:
            if (child := self._running()) is None:
                return super().expect(tier, blocks)
            child.tell(("expect", None, spec(tier), blocks))

    def changed(self, changes: list) -> None:
        with self.lock:
            if (child := self._running()) is None:
                return super().changed(changes)  # keeps saves' hints for when it starts
            child.tell(("changed", None, changes))

    def hit_many(self, hits: list) -> None:
        with self.lock:
            for tier_ids, _, key in hits:
                policy = self._tiers.get(tier_ids[0]) if tier_ids else None
                if policy is not None:
                    policy.admission.record(key)
            if (child := self._running()) is not None:
                child.tell(("hits", None, hits))

    def forget(self, tier_id: int) -> None:
        with self.lock:
            super().forget(tier_id)
            self._built.discard(tier_id)
            if (child := self._running()) is not None:
                child.tell(("forget", None, tier_id))

    def unbuild(self, tier) -> None:
        with self.lock:
            self._built.discard(tier.id)
            if (child := self._running()) is not None:
                child.tell(("unbuild", None, spec(tier)))

    # ---- asked ----------------------------------------------------------------------------

    def built(self, tier) -> bool:
        with self.lock:
            return tier.id in self._built and self._running() is not None

    def build(self, tier, read_rows=None) -> None:
        """The child builds the tier's order from SQL (unless it holds it); the admission replays
        the read blocks' hits here, in chunks."""
        with self.lock:
            self._of(tier)
            child = self._start()
        if child is None:
            return
        ok, recorded = child.ask("build", spec(tier))
        if not ok:
            log.error("the eviction order of tier %d was not built: %s", tier.id, recorded)
            return
        policy = self._of(tier)
        for start in range(0, len(recorded), REPLAY_AT_ONCE):
            with self.lock:
                for key, hits in paced(recorded[start : start + REPLAY_AT_ONCE]):
                    record_hits(policy.admission, key, hits)
        with self.lock:
            if child is self._child and child.alive:
                self._built.add(tier.id)

    def evict(self, tier, n: int, keep: set[int]) -> list[int] | None:
        child = self._running()
        if child is None:
            return None
        ok, victims = child.ask("evict", spec(tier), n, keep)
        return victims if ok else None

    def peek(self, tier, n: int, keep: set[int]) -> None:
        return None  # a dry run asks `dry_run`

    def dry_run(self, tier, limit: int, keep: set[int], to_free: int) -> tuple[int, int] | None:
        child = self._running()
        if child is None or not self.built(tier):
            return None
        ok, totals = child.ask("dry_run", spec(tier), limit, keep, to_free)
        return tuple(totals) if ok else None
