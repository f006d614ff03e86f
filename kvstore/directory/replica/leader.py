"""Several directory replicas on one PostgreSQL database: one leads, the others follow.

    leader = Leader(directory, changelog, engine, advertise_url)
    leader.enabled            # PostgreSQL: replicas may run side by side; SQLite: one directory, the leader
    leader.leading            # this replica writes; the others forward every call but lookups to it
    leader.run(stop, reap, refresh)   # the background thread: follow and campaign, then lead
    leader.forward(method, target, body, headers) -> (status, payload)   # a follower's call to the leader

`directory` is anything with the few calls of `Directory` below (the service is one); the
term check and the change log of every commit are `db.changelog.ChangeLog`, which the
directory's writer was built with; the role it sets (leading, term, why it stopped) is the
log's `role` (`role.py`), which the rest of the replica reads.

The leader is the replica holding a PostgreSQL advisory lock, on a connection of its own: when its
process dies the connection closes and the lock is free at once, and a follower that asks for it
every CAMPAIGN_S takes over. Leading means what one directory does alone: the one writer (group
commit), the page credit, save reservations, the reaper and every worker call. Each new leader
raises the term in `directory_leader`; every commit of its writer first checks that the term is
still its own, so a leader that lost its lock without knowing it cannot write after its successor
has begun.

A leader whose lock connection dropped (the database restarted, or the network cut it) takes the
lock again when the database answers; if another replica took it, or led meanwhile, this one
steps down: it drops what only a leader holds, reads its index from SQL again and follows (and
campaigns) as at its start. It never stays up without a role: it serves as a follower at once.

Followers answer lookups from their own index, which follows the leader's commits: each group
commit of the leader logs the blocks it touched (and whether workers, tiers or namespaces changed,
and the hand-offs it committed) in `changes`, in the same transaction, and notifies; a follower
reads the log on the notification, or every CAMPAIGN_S at the latest, and reads those blocks again.
A stale index can only make a lookup miss or report a block a moment longer: loads are forwarded,
and the leader pins in SQL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvstore.client.http import JsonHttp
from kvstore.core.errors import KVStoreError
from kvstore.directory.db import changelog as sql
from kvstore.directory.db.changelog import ChangeLog
from kvstore.directory.settings import DirectorySettings

if TYPE_CHECKING:
    from kvstore.directory.db.engine import Engine, Session, sessionmaker

log = logging.getLogger(__name__)
CAMPAIGN_S = 0.5  # a follower asks for the lock this often, and reads the change log at least this often
RETENTION_S = 120.0  # changes are kept this long; a follower further behind rebuilds its index
BATCH = 1000  # changes read at once
LAG_S = 10.0  # a follower that has not read the change log for this long is not ready (/readyz)
COALESCE_S = 0.002  # after a notification, wait this long for more before reading the log
BACKOFF_S = (0.5, 10.0)  # after a failed round, the first and the longest wait before the next


class Directory(Protocol):
    """What the election needs of the directory it runs."""
    sessions: sessionmaker[Session]
    settings: DirectorySettings

    def start(self, rebuild_index: bool = True) -> None:
        """Recover and start as the one directory that writes."""

    def step_down(self) -> None:
        """No longer the one that writes: drop what only the leader holds in memory."""

    def excuse_silence(self) -> None:
        """Every live worker gets a full heartbeat timeout from now (its heartbeats could not be recorded)."""

    def follow_from(self, session: Session, now: float) -> int:
        """Rebuild what a follower answers from (index, namespaces, hand-offs); returns the blocks indexed."""

    def apply(self, session: Session, changes: sql.Changes) -> None:
        """Bring what a follower answers from up to date with a batch of the leader's changes."""

    def write(self, job: Callable) -> object:
        """Run a job on the directory's one writer."""

    def reread(self, adopt: Callable[[Session], None]) -> None:
        """The leader's index, page credit and reservations from SQL again (relaxed commits were lost)."""


class Leader:
    def __init__(self, directory: Directory, changelog: ChangeLog, engine: Engine, advertise_url: str | None,
                 clock: Callable[[], float] = time.time):
        self._directory = directory
        self._log = changelog
        self._role = changelog.role
        self._engine = engine
        self._sessions = directory.sessions
        self._settings = directory.settings
        self._clock = clock
        self.url = advertise_url or ""
        self.enabled = changelog.enabled
        self.leader_url = self.url if self.leading else ""
        self.live_workers = 0  # a follower's count, from SQL (the leader counts heartbeats itself)
        self._last = 0  # the last change this replica's index has applied
        self._started = False  # start() has run: this replica leads and has recovered
        self._excused = True  # workers' heartbeats were recorded all along (False after the lock's connection dropped)
        self._followed = False  # the index was built from SQL to follow the leader
        self._conn = None  # psycopg connection: holds the lock (leader), listens (follower)
        self._checkpoints: deque[tuple[float, int]] = deque()  # (when, highest change id then): pruning
        self._leader: JsonHttp | None = None
        self._leader_lock = threading.Lock()

    @property
    def leading(self) -> bool:
        return self._role.leading

    @property
    def stepping_down(self) -> str:
        """Why this replica stopped leading, while it has not stepped down yet ("" otherwise)."""
        return self._role.lost if self._started and not self.leading else ""

    @property
    def term(self) -> int:
        return self._role.term

    @property
    def lag_s(self) -> float:
        return self._role.lag_s

    # ---- the background thread ------------------------------------------------------------------

    def run(self, stop: threading.Event, reap: Callable[[], None], refresh: Callable[[], None]) -> None:
        """Follow and campaign until this replica leads (at once without PostgreSQL), then reap
        every tick. `refresh` runs every tick in both roles (credentials read again). A database
        error ends no role: the round is tried again after a back-off (a follower reconnects and
        reads the change log from where it stopped), until `stop`. A leader that lost the lead
        follows again."""
        wait = BACKOFF_S[0]
        while not stop.is_set():
            try:
                if self._started and not self.leading:  # it led; its lock or its term was taken meanwhile
                    self._step_down()
                if self.leading and self._started:
                    self._lead(reap, refresh)
                    if self.leading:  # else it steps down at once, not a tick later
                        stop.wait(self._settings.reaper_interval_s)
                elif not self.enabled:
                    self._directory.start()
                    self._started = True
                else:
                    self._follow_round(stop, refresh)
                wait = BACKOFF_S[0]
            except Exception as exc:  # noqa: BLE001 (the database is away, or a round failed: try again)
                log.warning("the directory's background round failed, again in %.1f s: %s", wait, exc)
                if not self.leading:
                    self._disconnect()  # a follower reconnects and listens again
                stop.wait(wait)
                wait = min(wait * 2, BACKOFF_S[1])

    def _lead(self, reap: Callable[[], None], refresh: Callable[[], None]) -> None:
        if self.enabled and not self._holds_lock():
            regained = self._regain()
            if regained is False:
                self._role.lose("it lost the leader's lock (its database connection dropped) and another "
                               "replica has led since")
                return
            if regained is None:
                return  # the database does not answer: nothing to reap, nobody else can lead either
            self._restarted()
            self._excused = False
        if self._log.stale:  # first: no commit passes until then
            log.warning("the database restarted and may have lost the last relaxed commits: reading the index, "
                        "page credit and reservations from SQL again")
            self._directory.reread(self._log.adopt)
        if not self._excused:  # before any reap: the outage must not count as the workers' silence
            self._directory.excuse_silence()
            self._excused = True
        reap()
        self._prune()
        refresh()

    def _follow_round(self, stop: threading.Event, refresh: Callable[[], None]) -> None:
        """Connect (the first time: the index from SQL), campaign, and promote or follow for a while."""
        if self._conn is None:
            self._connect()
            if not self._followed or self._restarted():
                self._follow_start()
                self._followed = True
        if self._campaign():
            self._promote()
            return
        self._follow(stop, CAMPAIGN_S)
        refresh()

    def _restarted(self) -> bool:
        """With relaxed commits: the database restarted since this replica read its index (the
        changes it applied since may be lost: it reads the index again)."""
        with self._sessions() as session:
            return self._log.restarted(session)

    def _disconnect(self) -> None:
        """Drop the lock's and notifications' connection (a lock held on it is let go)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 (already broken)
                pass

    def _connect(self, listen: bool = True) -> None:
        self._conn = sql.connect(self._engine, listen)

    def _campaign(self) -> bool:
        """Take the lock if it is free; else learn who leads and how many workers live."""
        if sql.try_lock(self._conn):
            return True
        now = self._clock()
        with self._sessions() as session:
            self._set_leader(sql.leader_url(session))
            self.live_workers = sql.live_workers(session, now - self._settings.heartbeat_timeout_s)
        return False

    def _promote(self) -> None:
        """Raise the term (the old leader's writer can commit no more), apply what it committed
        last, then start as the one directory does: recover, page credit, reaper. All or nothing:
        if any step fails, the lock is let go and this replica follows again (another may lead)."""
        try:
            with self._sessions.begin() as session:
                term = sql.raise_term(session, self.url, self._clock())
                reread = self._log.restarted(session)  # since this follower's index was read
                self._log.adopt(session)
            self._apply_changes()
            self._role.lead(term)
            self._directory.start(rebuild_index=reread)
            sql.unlisten(self._conn)
        except BaseException:
            self._role.leading = False
            self._disconnect()
            raise
        self._started = self._excused = True  # recover() gave every live worker a full heartbeat timeout
        self._role.leading = True
        self._set_leader(self.url)
        log.info("this directory replica leads now (term %d)", self.term)

    def _holds_lock(self) -> bool:
        return sql.still_connected(self._conn)

    def _regain(self) -> bool | None:
        """After the lock's connection dropped: reconnect and take the lock again. True if this
        replica still leads (nobody raised the term meanwhile: a new leader's first write does),
        False if another replica leads or has led, None while the database cannot be reached."""
        self._disconnect()
        try:
            self._connect(listen=False)
            if not sql.try_lock(self._conn):
                return False
            with self._sessions() as session:
                if sql.term(session) != self.term:
                    return False
        except Exception as exc:  # noqa: BLE001 (the database is away: try again next tick)
            log.warning("the leader's lock connection is down, reconnecting: %s", exc)
            return None
        log.info("the leader's lock is held again (term %d)", self.term)
        return True

    def _step_down(self) -> None:
        """Follow again, as at the start: another replica leads (or led while this one's lock
        connection was down), so what this one holds as the leader (reservations, page credit,
        heartbeats heard, its index) may be stale. The next follow round connects and reads the
        index from SQL; a later promotion builds the rest from SQL, as any promotion does."""
        log.warning("this directory replica steps down (%s): it follows the leader again", self._role.lost)
        self._started = self._followed = False
        self._disconnect()  # its lock, if it still held it, goes with the connection
        self._set_leader("")  # learned again by the next campaign: no call is forwarded to itself meanwhile
        self._directory.step_down()

    # ---- the change log ---------------------------------------------------------------------------------

    def _prune(self) -> None:
        """Changes older than RETENTION_S go (by id, found from a checkpoint taken back then)."""
        if not self.enabled:
            return
        now = self._clock()
        if not self._checkpoints or now - self._checkpoints[-1][0] >= RETENTION_S / 4:
            with self._sessions() as session:
                self._checkpoints.append((now, sql.last_change(session)))
        if self._checkpoints[0][0] > now - RETENTION_S:
            return
        _, below = self._checkpoints.popleft()

        self._directory.write(lambda tx: sql.prune(tx.session, below))

    # ---- following ----------------------------------------------------------------------------------

    def _follow_start(self) -> None:
        """The index from SQL; changes logged from here on are applied after it (again, harmlessly,
        if the rebuild already saw them)."""
        with self._sessions() as session:
            self._last = sql.last_change(session)
            self._log.adopt(session)
        with self._sessions() as session:
            blocks = self._directory.follow_from(session, self._clock())
        log.info("following the leader: index of %d blocks", blocks)

    def _follow(self, stop: threading.Event, wait_s: float) -> None:
        """Apply the change log now, then whenever the leader notifies, for `wait_s`."""
        deadline = time.monotonic() + wait_s
        while not stop.is_set():
            self._apply_changes()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if any(True for _ in self._conn.notifies(timeout=left, stop_after=1)):
                for _ in self._conn.notifies(timeout=COALESCE_S):  # a burst of commits: read them at once
                    pass

    def _apply_changes(self) -> None:
        while True:
            with self._sessions() as session:
                if self._last + 1 < sql.pruned_below(session):  # what we missed is gone from the log
                    log.warning("this replica fell behind the change log; rebuilding its index")
                    self._follow_start()
                    continue
                changes = sql.changes_after(session, self._last, BATCH)
                self._role.followed()
                if changes is None:
                    return
                self._directory.apply(session, changes)
                self._last = changes.last
            if changes.count < BATCH:
                return

    # ---- forwarding -----------------------------------------------------------------------------------

    def _set_leader(self, url: str) -> None:
        with self._leader_lock:
            if url != self.leader_url:
                old, self._leader = self._leader, None
                self.leader_url = url
                if old is not None:
                    old.close()

    def _leader_client(self) -> JsonHttp | None:
        with self._leader_lock:
            if self.leader_url == self.url:  # it lost the lead a moment ago and has not stepped down yet
                return None
            if self._leader is None and self.leader_url:
                self._leader = JsonHttp(self.leader_url, timeout_s=self._settings.move_timeout_s + 30,
                                        ca_file=self._settings.ca_file)
            return self._leader

    def forward(self, method: str, target: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """A follower's call, sent on to the leader as it came (its credential included: the leader
        checks it). An unreachable leader is a 503: the client tries another replica."""
        client = self._leader_client()
        if client is not None:
            try:
                return client.exchange(method, target, body or None, headers)
            except KVStoreError:
                pass
        raise KVStoreError("unavailable", "the leading directory replica does not answer; another replica takes "
                           "over within seconds", leader=self.leader_url)

    def close(self) -> None:
        """Let go of the lock (a follower takes over at once) and of the connections to the leader."""
        self._set_leader("")
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 (closing at exit: nothing left to do about it)
                pass
