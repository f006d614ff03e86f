"""Each tier's eviction order in a child process, behind `TierPolicies`' calls.

    policies = ChildOrder(eviction, admission, database_url)   # admission stays in this process
    policies.build(tier, read_rows)    # the child builds the tier's order from SQL (read_rows unused)
    policies.evict(tier, n, keep)      # its next victims; None: it ran dry; raises Unanswered
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
SQL by the caller, as the policies' always were. A build is asked once per tier and waited for
outside the writer, as one in this process was; the next victims, asked inside a writer's job, are
waited for at most EVICT_WAIT_S (behind a dry run or another tier's build), then the job takes SQL's
order (least recently used first) and victims answered later go back into the order. If the child
ends, or answers nothing for ASK_TIMEOUT_S, evictions take SQL's order until it is started again,
RESTART_AFTER_S after its end at the earliest, and it builds its orders from SQL anew.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from kvstore.directory.moves.order_child import TierSpec, read_frame, write_frame
from kvstore.directory.tier_policies import TierPolicies, Unanswered, record_hits

log = logging.getLogger(__name__)
RESTART_AFTER_S = 30.0  # after the child ended, the next order it is needed for starts it again
ASK_TIMEOUT_S = 600.0  # a child that answers nothing for this long is stopped
EVICT_WAIT_S = 5.0  # a writer's job waits this long for the next victims, then takes SQL's order
REPLAY_AT_ONCE = 10_000  # admission counts replayed under one hold of the lock


def spec(tier) -> TierSpec:
    return TierSpec(tier.id, tier.kind, tier.capacity_bytes, tier.page_bytes)


class _Ask:
    """An ask on its way: answered (ok, value), or left unanswered when the child ended."""

    def __init__(self, kind: str, then: Callable[[bool, object], None] | None) -> None:
        self.kind, self.then = kind, then
        self.done = threading.Event()
        self.ok, self.value = False, "the eviction order's process is not running"
        self.abandoned = False  # the asker stopped waiting: `late` gets the answer instead
        self.late: Callable[[object], None] | None = None


class _Child:
    """One run of the child process: its pipe, a thread that writes to it, one that reads answers."""

    def __init__(self, eviction: dict[str, str], database_url: str) -> None:
        # -P: not the working directory's packages; its own session: a ^C to the directory is not its
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "kvstore.directory.moves.order_child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.alive = True
        self.ended_at = float("inf")
        self._outbox: deque = deque([("start", eviction, database_url)])
        self._asks: dict[int, _Ask] = {}
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._since: float | None = None  # monotonic time since which an ask waits for its answer
        threading.Thread(target=self._send, name="order-send", daemon=True).start()
        threading.Thread(target=self._receive, name="order-receive", daemon=True).start()

    def tell(self, message: tuple) -> None:
        with self._cond:
            if self.alive:
                self._outbox.append(message)
                self._cond.notify()

    def request(self, kind: str, *args, then: Callable[[bool, object], None] | None = None) -> _Ask:
        """Sends an ask; `then(ok, value)` runs on the answer (on the reading thread)."""
        ask = _Ask(kind, then)
        with self._cond:
            if not self.alive:
                ask.done.set()
                return ask
            request = next(self._ids)
            self._asks[request] = ask
            if self._since is None:
                self._since = time.monotonic()
            self._outbox.append((kind, request, *args))
            self._cond.notify()
        return ask

    def ask(self, kind: str, *args, timeout_s: float = ASK_TIMEOUT_S,
            late: Callable[[object], None] | None = None) -> tuple[bool, object]:
        """(True, the answer) or (False, why not); waits without the interpreter. Unanswered within
        `timeout_s`, the ask is left to `late` (its answer, if one comes)."""
        ask = self.request(kind, *args)
        if not ask.done.wait(timeout_s):
            with self._cond:
                ask.abandoned, ask.late = True, late
            return False, f"no answer within {timeout_s:.0f} s"
        return ask.ok, ask.value

    def stalled(self) -> bool:
        """An ask its caller stopped waiting for is still unanswered (the next would wait as long);
        one unanswered for ASK_TIMEOUT_S stops the child."""
        with self._cond:
            since = self._since
            stalled = any(a.abandoned for a in self._asks.values())
        if since is not None and time.monotonic() - since > ASK_TIMEOUT_S:
            self.stop(f"no answer for {ASK_TIMEOUT_S:.0f} s")
            return True
        return stalled

    def _send(self) -> None:
        try:
            while True:
                with self._cond:
                    while self.alive and not self._outbox:
                        self._cond.wait()
                    if not self.alive:
                        return
                    batch = list(self._outbox)
                    self._outbox.clear()
                for message in batch:
                    write_frame(self.proc.stdin, message)
        except Exception as exc:  # a closed pipe (the child ended), or a message that cannot be sent
            self.stop(f"writing to it failed: {type(exc).__name__}: {exc}")

    def _receive(self) -> None:
        try:
            while (message := read_frame(self.proc.stdout)) is not None:
                request, ok, value = message
                with self._cond:
                    ask = self._asks.pop(request, None)
                    self._since = time.monotonic() if self._asks else None
                if ask is None:
                    continue
                ask.ok, ask.value = ok, value
                if ask.then is not None:
                    ask.then(ok, value)
                ask.done.set()
                if ask.abandoned and ok and ask.late is not None:
                    ask.late(value)
            self.stop("its output closed")
        except Exception as exc:  # a torn or foreign frame
            self.stop(f"reading from it failed: {type(exc).__name__}: {exc}")

    def stop(self, why: str | None = None) -> None:
        """Ends the child (why: unexpectedly, which is logged); what it was asked goes unanswered."""
        with self._cond:
            was, self.alive = self.alive, False
            if was:
                self.ended_at = time.monotonic()
            asks = list(self._asks.values())
            self._asks.clear()
            self._since = None
            self._cond.notify_all()
        if not was:
            return
        if why is not None:
            log.error("the eviction order's process ended (%s; exit status %s): evictions take SQL's order "
                      "until it is started again", why, self.proc.poll())
        self.proc.kill()  # it holds nothing to save; a writer blocked on a full pipe is released
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):  # a buffered write that cannot be flushed any more
                pass
        for ask in asks:
            if ask.then is not None:
                ask.then(False, ask.value)
            ask.done.set()


class ChildOrder(TierPolicies):
    """`TierPolicies` whose eviction orders live in a child process; admissions stay here."""

    local = False

    def __init__(self, eviction: dict[str, str], admission: dict[str, str], database_url: str,
                 spawn: Callable[[dict[str, str], str], _Child] = _Child) -> None:
        super().__init__(eviction, admission)
        self._url = database_url
        self._spawn = spawn  # a child from (eviction names, database URL)
        self._child: _Child | None = None
        self._built: set[int] = set()  # tiers whose order the running child holds
        self._building: dict[int, _Ask] = {}  # tier id -> its build, asked and not answered yet
        self._generation: Counter = Counter()  # tier id -> bumped when its order is dropped
        self._replayed: set[int] = set()  # tiers whose admission took the recorded hits (once)
        self._closed = False

    def _running(self) -> _Child | None:
        child = self._child
        return child if child is not None and child.alive else None

    def _start(self) -> _Child | None:
        """The running child; started if there is none (RESTART_AFTER_S after one ended), with the
        hints kept here meanwhile. Under `lock`, so no hint or change passes it on the way."""
        if (child := self._running()) is not None:
            return child
        if self._closed or (self._child is not None and
                            time.monotonic() - self._child.ended_at < RESTART_AFTER_S):
            return None
        self._built.clear()
        self._building.clear()
        try:
            self._child = self._spawn(self._names[0], self._url)
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
            self._drop(tier_id)
            if (child := self._running()) is not None:
                child.tell(("forget", None, tier_id))

    def unbuild(self, tier) -> None:
        with self.lock:
            self._drop(tier.id)
            if (child := self._running()) is not None:
                child.tell(("unbuild", None, spec(tier)))

    def _drop(self, tier_id: int) -> None:
        """The child's order of the tier is gone or going: a build under way no longer counts."""
        self._built.discard(tier_id)
        self._building.pop(tier_id, None)
        self._generation[tier_id] += 1

    # ---- asked ----------------------------------------------------------------------------

    def built(self, tier) -> bool:
        with self.lock:
            return tier.id in self._built and self._running() is not None

    def build(self, tier, read_rows=None) -> None:
        """The child builds the tier's order from SQL (unless it holds it or is building it); waits
        up to ASK_TIMEOUT_S for it. Its answer, whenever it comes, makes the tier built here unless
        its order was dropped meanwhile, and the admission replays the hits of the blocks it read
        (the first time only)."""
        with self.lock:
            self._of(tier)
            if (child := self._start()) is None or tier.id in self._built:  # a new child holds no order yet
                return
            ask = self._building.get(tier.id)
            if ask is None:
                generation = self._generation[tier.id]
                ask = self._building[tier.id] = child.request(
                    "build", spec(tier), then=lambda ok, value: self._built_answer(tier, child, generation, ok, value))
        ask.done.wait(ASK_TIMEOUT_S)

    def _built_answer(self, tier, child: _Child, generation: int, ok: bool, recorded) -> None:
        if not ok:
            log.error("the eviction order of tier %d was not built: %s", tier.id, recorded)
            with self.lock:
                if self._generation[tier.id] == generation:
                    self._building.pop(tier.id, None)
            return
        if tier.id not in self._replayed:
            self._replayed.add(tier.id)
            for start in range(0, len(recorded), REPLAY_AT_ONCE):
                with self.lock:
                    admission = self._of(tier).admission
                    for key, hits in recorded[start : start + REPLAY_AT_ONCE]:
                        record_hits(admission, key, hits)
        with self.lock:
            if child is self._child and child.alive and self._generation[tier.id] == generation:
                self._building.pop(tier.id, None)
                self._built.add(tier.id)

    def evict(self, tier, n: int, keep: set[int]) -> list[int] | None:
        """The next victims of the tier's order; None when it ran dry. Raises Unanswered when the
        child is not running, left an earlier ask unanswered, or answers nothing within EVICT_WAIT_S
        (behind another tier's build, say): the caller then takes SQL's order."""
        child = self._running()
        if child is None or child.stalled() or not self.built(tier):
            raise Unanswered("the eviction order is not at hand")

        def late(victims) -> None:  # named, but nobody took them: back into the order
            if victims:
                self.changed([(block_id, None, "", "", [tier.id], []) for block_id in victims])
        ok, victims = child.ask("evict", spec(tier), n, keep, timeout_s=EVICT_WAIT_S, late=late)
        if not ok:
            raise Unanswered(str(victims))
        return victims

    def peek(self, tier, n: int, keep: set[int]) -> None:
        return None  # a dry run asks `dry_run`

    def dry_run(self, tier, limit: int, keep: set[int], to_free: int) -> tuple[int, int] | None:
        """The child walks its order and re-checks the victims in SQL; None when it cannot."""
        child = self._running()
        if child is None or not self.built(tier):
            return None
        ok, totals = child.ask("dry_run", spec(tier), limit, keep, to_free)
        return tuple(totals) if ok else None
