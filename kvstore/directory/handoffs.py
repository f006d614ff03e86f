"""Hand-offs between a prefill engine and a decode engine: who committed what, and who waits for it.

    handoffs.commit(HandoffCommit) -> HandoffState     # the leader: the row, then the waiters here woken
    await handoffs.wait(HandoffWait) -> HandoffState   # any replica: until the hand-off is known, every
                                                       # block the consumer named is stored, or timeout_s
    handoffs.learned(rows)                             # a follower applied the leader's change log
    handoffs.expire(tx, now)                           # the reaper's job: rows older than KEEP_S go

The caller has checked that the namespace is the caller's.

A producer commits a hand-off once every save of its prompt has committed, so the blocks are in
the lookup index (the leader's at once; a follower's before it learns of the hand-off, since it
applies the change log in order) by the time a waiter hears of it. The row is durable: a waiter
on another replica, or on a new leader after a failover, learns of it from SQL. A wait also ends
when every block the consumer named is stored, so a commit that never comes (the producer died
after its last save) costs the consumer nothing; it is polled every PRESENCE_POLL_S.

Waiters are asyncio events on the replica's event loop, woken from the writer thread (leader) or
the follower's background thread with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import HandoffCommit, HandoffState, HandoffWait
from kvstore.directory.db import repository as repo
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.db.models import HandoffRow
from kvstore.directory.db.writer import Tx, Write

KEEP_S = 600.0  # a hand-off is remembered this long after its commit
MAX_KNOWN = 200_000  # in memory; the oldest are forgotten first (SQL still has them)
MAX_WAITERS = 4096  # waits open at once on one replica; more are refused (429): ask again
MAX_WAITERS_PER_CALLER = 512  # of them, what one token may hold: one tenant cannot take every slot
PRESENCE_POLL_S = 0.25
FOLLOWER_LAG_S = 1.0  # a follower trusts a row it read itself after this, if the change log has not brought it


class Key(NamedTuple):
    namespace_id: str
    handoff_id: str

    def encode(self) -> str:
        return f"{self.namespace_id}/{self.handoff_id}"  # neither part may hold a '/' or a ','


class Known(NamedTuple):
    state: str  # committed / failed
    num_tokens: int
    committed_at: float

    def answer(self, handoff_id: str, waited_s: float = 0.0) -> HandoffState:
        return HandoffState(handoff_id=handoff_id, state=self.state, num_tokens=self.num_tokens,
                            committed_at=self.committed_at, waited_s=waited_s)


class Handoffs:
    def __init__(self, write: Write, sessions, count: Callable[[str, list[str]], tuple], metrics: DirectoryMetrics,
                 leading: Callable[[], bool] = lambda: True, clock: Callable[[], float] = time.time) -> None:
        """`write`: the writer's run; `sessions`: for reads; `count`: the lookup index's leading hits;
        `leading`: whether this replica leads (its index holds every commit)."""
        self._write = write
        self._leading = leading
        self._sessions = sessions
        self._count = count
        self._metrics = metrics
        self._clock = clock
        self._known: OrderedDict[Key, Known] = OrderedDict()
        self._waiters: dict[Key, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._num_waiters = 0
        self._by_caller: dict[str, int] = {}  # open waits per token id ('' when credentials are off: not counted)
        self._lock = threading.Lock()

    def commit(self, commit: HandoffCommit) -> HandoffState:
        """The hand-off's row (a second commit of the same id replaces the first), marked for the
        change log; the waiters here hear of it once the group has committed."""
        key = Key(commit.namespace_id, commit.handoff_id)

        def job(tx: Tx) -> Known:
            known = Known("failed" if commit.failed else "committed", commit.num_tokens, self._clock())
            row = repo.handoff_row(tx.session, key)
            row.state, row.num_tokens, row.committed_at = known.state, known.num_tokens, known.committed_at
            row.finished_at = commit.finished_at
            tx.session.info.setdefault("handoffs", set()).add(key.encode())
            tx.after_commit.append(lambda: self._learn(key, known))
            return known
        known = self._write(job)
        self._metrics.handoffs.labels(known.state).inc()
        if commit.finished_at is not None:
            self._metrics.handoff_latency.observe(max(0.0, known.committed_at - commit.finished_at))
        return known.answer(key.handoff_id)

    def learned(self, rows: list[HandoffRow]) -> None:
        for row in rows:
            self._learn(Key(row.namespace_id, row.handoff_id), _known(row))

    async def wait(self, req: HandoffWait, caller: str = "") -> HandoffState:
        """Until the hand-off is known here or in SQL, every block the consumer named is stored, or
        `timeout_s` has passed. `caller`: the token's id, whose open waits are bounded."""
        state = await self._wait(Key(req.namespace_id, req.handoff_id), lambda: self._present(req), req.timeout_s,
                                 caller)
        self._metrics.handoff_waits.labels(state.state).observe(state.waited_s)
        return state

    def _present(self, req: HandoffWait) -> bool:
        """Every block named is stored (the last one first: the common answer, no, costs one probe)."""
        return bool(req.hashes) and self._count(req.namespace_id, req.hashes[-1:])[0] == 1 and \
            self._count(req.namespace_id, req.hashes)[0] == len(req.hashes)

    def _read(self, key: Key) -> HandoffRow | None:
        with self._sessions() as session:
            rows = repo.handoff_rows(session, [key.encode()])
            return rows[0] if rows else None

    async def _wait(self, key: Key, present: Callable[[], bool], timeout_s: float, caller: str) -> HandoffState:
        loop, started = asyncio.get_running_loop(), time.monotonic()
        deadline, event = started + timeout_s, asyncio.Event()
        with self._lock:  # listening before SQL is read: a commit in between still wakes us
            if self._num_waiters >= MAX_WAITERS:
                raise KVStoreError("throttled", f"{MAX_WAITERS} hand-off waits are open on this directory replica; "
                                   "ask again", retry_after_s=1.0)
            if caller and self._by_caller.get(caller, 0) >= MAX_WAITERS_PER_CALLER:
                raise KVStoreError("throttled", f"this token holds {MAX_WAITERS_PER_CALLER} open hand-off waits "
                                   "on this directory replica; ask again", retry_after_s=1.0)
            self._waiters.setdefault(key, set()).add((loop, event))
            self._num_waiters += 1
            if caller:
                self._by_caller[caller] = self._by_caller.get(caller, 0) + 1
        try:
            known, unconfirmed, trust_at = self._get(key), None, 0.0
            if known is None:
                row = await asyncio.to_thread(self._read, key)
                if row is not None and self._leading():
                    self.learned([row])
                    known = self._get(key)
                elif row is not None:  # a follower may read the row before the blocks committed ahead of it
                    unconfirmed, trust_at = _known(row), time.monotonic() + FOLLOWER_LAG_S
            while known is None and not present():
                now = time.monotonic()
                if unconfirmed is not None and now >= trust_at:
                    known = unconfirmed
                    break
                if now >= deadline:
                    break
                limit = min(deadline, trust_at) if unconfirmed is not None else deadline
                try:
                    await asyncio.wait_for(event.wait(), max(0.0, min(limit - now, PRESENCE_POLL_S)))
                except TimeoutError:
                    pass
                woken = event.is_set()
                event.clear()
                known = self._get(key)
                if woken and known is None:  # learned, then forgotten already (MAX_KNOWN): SQL still has it
                    row = await asyncio.to_thread(self._read, key)
                    known = _known(row) if row is not None else None
        finally:
            with self._lock:
                waiting = self._waiters.get(key, set())
                waiting.discard((loop, event))
                self._num_waiters -= 1
                if caller:
                    self._by_caller[caller] -= 1
                    if not self._by_caller[caller]:
                        del self._by_caller[caller]
                if not waiting:
                    self._waiters.pop(key, None)
        waited = time.monotonic() - started
        if known is not None:
            return known.answer(key.handoff_id, waited)
        return HandoffState(handoff_id=key.handoff_id, state="present" if present() else "pending", waited_s=waited)

    def learn_recent(self, session, now: float) -> None:
        """What the last KEEP_S committed (a follower that rebuilt its index skipped its change log)."""
        self.learned(repo.recent_handoffs(session, now - KEEP_S, MAX_KNOWN))

    def expire(self, tx: Tx, now: float) -> int:
        """A job: rows committed more than KEEP_S ago are deleted (and forgotten here)."""
        with self._lock:
            while self._known and next(iter(self._known.values())).committed_at < now - KEEP_S:
                self._known.popitem(last=False)
        return repo.delete_handoffs_before(tx.session, now - KEEP_S)

    def waiting(self) -> int:
        with self._lock:
            return self._num_waiters

    def _get(self, key: Key) -> Known | None:
        with self._lock:
            return self._known.get(key)

    def _learn(self, key: Key, known: Known) -> None:
        with self._lock:
            self._known[key] = known
            self._known.move_to_end(key)
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)
            waiters = list(self._waiters.get(key, ()))
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop has closed (shut-down): nobody waits there any more
                pass


def _known(row: HandoffRow) -> Known:
    return Known(row.state, row.num_tokens, row.committed_at)
