"""Every change to the directory's tables, on one writer thread, with group commit.

    writer = Writer(sessions, on_commit)
    writer.run(job) -> what job(tx) returned     # from any thread; raises what the job raised
    await writer.run_async(job, relaxed=False)   # the same from the event loop, which it does not block
    writer.run_alone(job)                        # in a group of its own
    writer.close()

A job runs inside a SAVEPOINT of the writer's transaction; jobs that queue up
while a COMMIT is under way run together and share the next one, so a burst of
saves pays for one durable commit instead of one each. A group whose jobs only
read (most of the reaper's) writes no commit mark and no change-log row. A job
that raises is rolled back to its savepoint alone (a job alone in its group needs no
SAVEPOINT: the transaction is its own). Only after the COMMIT returns does the
writer call `on_commit` (the lookup index follows the rows the group touched)
and then the jobs' `after_commit` calls (worker frees, page pools), and only
then are the callers answered: nothing a caller is told about is lost, and
nothing a lookup sees is uncommitted. A COMMIT whose answer is lost is resolved by its commit
mark: asked about for RESOLVE_S, then its callers are told the outcome is unknown, and a resolver
thread asks on until the database answers; the group is then settled on the writer's thread as
it would have been at once (committed: the index reads its blocks back, the after-commit work
runs; rolled back: the rollback work runs), so no reservation stays taken and no committed block
stays out of the index. `before_commit`, when set, runs last in every group's
transaction: the leader of several directory replicas checks its term there and logs what the
group changed for the others (`changelog.py`); what it raises rolls the group back.

Jobs must not do I/O other than SQL: worker calls happen before or after a
job, never inside one.

Relaxed commits (`Writer(relax=True)`, PostgreSQL only): a group whose jobs
were all submitted `relaxed` (saves' completions) commits with
`synchronous_commit = off`: the COMMIT returns once the database has applied
it, before its WAL reaches the disk, so a database crash can lose such groups
(never a group that waited for its flush: that flush writes every earlier
commit too). What happens then is `changelog.ChangeLog`'s: no group commits
until the directory has read everything back from SQL.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from sqlalchemy import delete, event, text
from sqlalchemy.orm import Session, sessionmaker

from kvstore.core.errors import KVStoreError
from kvstore.directory.db import direct
from kvstore.directory.db.models import CommitMark

log = logging.getLogger(__name__)
T = TypeVar("T")
RESOLVE_S = 30.0  # how long a lost COMMIT answer is asked about before its callers are told it is unknown
MAX_GROUP = 128  # jobs sharing one commit at most
NORMAL, RELAXED, ALONE, SETTLE = 0, 1, 2, 3  # how a job was submitted; SETTLE: a late outcome's follow-up
RELAX = text("SET LOCAL synchronous_commit TO OFF")


class Tx:
    """What a job gets: the session, and calls to make once the group commits (or if this job fails)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.after_commit: list[Callable[[], None]] = []
        self.on_rollback: list[Callable[[], None]] = []

    def committed(self, rows: list) -> None:
        """Replicas this job made READY, for the index to add without reading them back (rows the
        group also touched otherwise are read back anyway, after these are applied)."""
        self.session.info["committed"].extend(rows)



class Write(Protocol):
    """What the parts of the directory are given to change SQL: `Writer.run`."""

    def __call__(self, job: Callable[[Tx], T]) -> T: ...


class Writer:
    def __init__(self, sessions: sessionmaker[Session],
                 on_commit: Callable[[set[int], bool, list], None] | None = None,
                 before_commit: Callable[[Session, set[int], bool, bool, list, set[str]], None] | None = None,
                 relax: bool = False) -> None:
        self._sessions = sessions
        self.relax = relax
        self.on_commit = on_commit or (lambda blocks, topology, committed: None)
        self._before_commit = before_commit
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self.groups = self.jobs = 0  # for the group-commit ratio in /v1/admin/stats
        self.unresolved = 0  # groups whose COMMIT outcome is still unknown
        event.listen(sessions, "after_flush", _note_flushed)
        event.listen(sessions, "do_orm_execute", _note_executed)
        self._thread = threading.Thread(target=self._loop, name="directory-writer", daemon=True)
        self._thread.start()

    def run(self, job: Callable[[Tx], T]) -> T:
        assert threading.current_thread() is not self._thread, "a job cannot wait for another job"
        return self._submit(job, NORMAL).result()

    def run_alone(self, job: Callable[[Tx], T]) -> T:
        """`run`, in a group that holds no other job (one that replaces what the others work from)."""
        return self._submit(job, ALONE).result()

    def _submit(self, job, mode: int) -> Future:
        future: Future = Future()
        self._queue.put((job, future, mode))
        return future

    @property
    def queued(self) -> int:
        """Jobs waiting for the writer's thread (the group it runs now not counted)."""
        return self._queue.qsize()

    def read(self, job: Callable[[Tx], T]) -> T:
        """A job that only reads, on the caller's thread and its own session (rolled back): long reads
        (a whole tier) never hold the writer. It sees what was committed (on PostgreSQL, as each of its
        statements began: fine for answers that are advisory, such as a dry run's)."""
        with self._sessions() as session:
            return job(Tx(session))

    async def run_async(self, job: Callable[[Tx], T], relaxed: bool = False) -> T:
        """For the event loop: no thread of the pool waits for the writer, the loop is woken once.
        `relaxed`: the job's group may commit without waiting for the database's flush (above)."""
        return await asyncio.wrap_future(self._submit(job, RELAXED if relaxed else NORMAL))

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        held = None  # a job to run alone, met while a group was gathered: it starts the next one
        while True:
            first = held if held is not None else self._queue.get()
            held = None
            if first is None:
                return
            if first[2] == SETTLE:
                _settle(first)
                continue
            group = [first]
            while len(group) < MAX_GROUP and first[2] != ALONE:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this group
                    break
                if item[2] in (ALONE, SETTLE):
                    held = item
                    break
                group.append(item)
            try:
                self._run_group(group)
            except BaseException as exc:  # the loop must survive anything a group does
                log.exception("writer group failed")
                for _, future, _ in group:
                    if not future.done():
                        future.set_exception(exc)

    def _run_group(self, group: list[tuple[Callable[[Tx], Any], Future, int]]) -> None:
        outcomes: list[tuple[Tx, Future, Any, BaseException | None]] = []
        with self._sessions() as session:
            committed = session.info.setdefault("committed", [])
            alone = len(group) == 1  # no SAVEPOINT: a failure rolls back the transaction, which is its own
            for job, future, _ in group:
                tx = Tx(session)
                mark = len(committed)
                try:
                    if alone:
                        result = job(tx)
                        session.flush()
                    else:
                        with session.begin_nested():
                            result = job(tx)
                    outcomes.append((tx, future, result, None))
                except BaseException as exc:
                    if alone:
                        session.rollback()
                    del committed[mark:]  # what the failed job committed to the index is void
                    _run_all(tx.on_rollback)
                    outcomes.append((tx, future, None, exc))
            touched = session.info.pop("touched_blocks", set())
            topology = session.info.pop("topology", False)
            namespaces = session.info.pop("namespaces", False)
            handoffs = session.info.pop("handoffs", set())  # hand-offs committed (handoffs.py)
            session.info.pop("committed")
            wrote = session.info.pop("wrote", False) or touched or topology or namespaces or committed or handoffs
            mark = secrets.token_hex(16)
            try:
                if wrote:  # a group that only read commits nothing: no mark, no term check, no change logged
                    direct.driver_many(session, "INSERT INTO commit_marks (id, at) VALUES (?, ?)",
                                       [(mark, time.time())])
                    if self.relax and all(mode == RELAXED for _, _, mode in group):
                        session.execute(RELAX)
                    if self._before_commit is not None:
                        self._before_commit(session, touched, topology, namespaces, committed, handoffs)
            except BaseException as exc:
                session.rollback()
                return _rolled_back(outcomes, exc)
            try:
                session.commit()
            except BaseException as exc:  # the COMMIT's answer was lost: did it happen?
                happened = self._committed(mark)
                if happened is None:
                    _unknown(outcomes, exc)
                    return self._resolve_later(mark, outcomes, touched | {row[0] for row in committed}, topology)
                if not happened:
                    return _rolled_back(outcomes, exc)
                log.warning("the answer to a COMMIT of %d jobs was lost (%s), but it happened", len(group), exc)
        self.groups += 1
        self.jobs += len(group)
        if touched or topology or committed:
            try:
                self.on_commit(touched, topology, committed)
            except Exception:  # committed is committed: the callers are answered and after-commit work runs
                log.exception("following a commit of %d jobs failed", len(group))
        for tx, future, result, error in outcomes:
            if error is None:
                _run_all(tx.after_commit)
                future.set_result(result)
            else:
                future.set_exception(error)


    def _resolve_later(self, mark: str, outcomes: list, touched: set[int], topology: bool) -> None:
        """Ask about `mark` until the database answers, then settle the group on the writer's thread."""
        self.unresolved += 1

        def resolve() -> None:
            happened = None
            while happened is None and not self._closed.is_set():
                happened = self._committed(mark)
            if happened is not None:
                self._submit(lambda: self._settle_late(happened, outcomes, touched, topology), SETTLE)

        threading.Thread(target=resolve, name="directory-commit-resolver", daemon=True).start()

    def _settle_late(self, happened: bool, outcomes: list, touched: set[int], topology: bool) -> None:
        """A group whose outcome its callers were told is unknown, now known. Its replicas are read
        back from SQL (not taken from the group's own rows: later groups may have changed them)."""
        self.unresolved -= 1
        log.warning("a group commit of %d jobs whose outcome was unknown %s", len(outcomes),
                    "happened" if happened else "did not happen")
        if happened and (touched or topology):
            try:
                self.on_commit(touched, topology, [])
            except Exception:
                log.exception("following a late commit of %d jobs failed", len(outcomes))
        for tx, _, _, error in outcomes:
            if error is None:
                _run_all(tx.after_commit if happened else tx.on_rollback)

    def _committed(self, mark: str) -> bool | None:
        """Whether the group that wrote `mark` committed; None if the database does not answer within
        RESOLVE_S."""
        deadline, wait = time.monotonic() + RESOLVE_S, 0.05
        while True:
            try:
                with self._sessions() as session:
                    return session.get(CommitMark, mark) is not None
            except Exception as exc:  # noqa: BLE001 (the database is away: ask again)
                if time.monotonic() + wait > deadline:
                    log.error("whether a group commit happened is unknown: %s", exc)
                    return None
                time.sleep(wait)
                wait = min(2 * wait, 2.0)


def forget_marks(session: Session, before: float) -> int:
    """Commit marks older than `before` (a lost COMMIT answer is resolved within RESOLVE_S)."""
    return session.execute(delete(CommitMark).where(CommitMark.at < before)).rowcount


def _rolled_back(outcomes: list, exc: BaseException) -> None:
    log.warning("group commit of %d jobs failed: %s", len(outcomes), exc)
    for tx, future, _, error in outcomes:
        if error is None:
            _run_all(tx.on_rollback)
        future.set_exception(error or KVStoreError("unavailable", f"database commit failed: {exc}"))


def _settle(item: tuple[Callable[[], None], Future, int]) -> None:
    settle, future, _ = item
    try:
        settle()
        future.set_result(None)
    except BaseException as exc:  # noqa: BLE001 (the loop must survive it)
        log.exception("settling a late commit outcome failed")
        future.set_exception(exc)


def _unknown(outcomes: list, exc: BaseException) -> None:
    """Neither committed nor rolled back as far as anyone can tell yet: the callers are told so, and
    neither the jobs' rollback nor their after-commit work runs until the outcome is known
    (`Writer._resolve_later`)."""
    for _, future, _, error in outcomes:
        future.set_exception(error or KVStoreError(
            "unavailable", f"the database did not say whether this commit happened ({exc}); look before "
            "retrying"))


def _note_executed(state) -> None:
    """A statement other than a SELECT (through the session) marks the group as one that wrote."""
    if not state.is_select:
        state.session.info["wrote"] = True


def _note_flushed(session: Session, _flush_context) -> None:
    """ORM changes of blocks, replicas, workers and tiers mark what the index must reload (and any
    flush, that the group wrote)."""
    session.info["wrote"] = True
    touched = session.info.setdefault("touched_blocks", set())
    for obj in (*session.new, *session.dirty, *session.deleted):
        name = type(obj).__name__
        if name == "Replica":
            touched.add(obj.block_id)
        elif name == "Block":
            touched.add(obj.id)
        elif name in ("Worker", "Tier"):
            session.info["topology"] = True
        elif name == "NamespaceRow":
            session.info["namespaces"] = True


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        try:
            call()
        except KVStoreError as exc:  # a worker that is gone keeps nothing: its epoch resets its pages
            log.warning("call after a transaction failed: %s", exc)
        except Exception:
            log.exception("call after a transaction failed")
