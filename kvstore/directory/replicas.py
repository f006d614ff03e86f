"""Several directory replicas on one PostgreSQL database: one leads, the others follow.

    replicas = Replicas(service, engine, advertise_url)
    replicas.enabled          # PostgreSQL: replicas may run side by side; SQLite: one directory, the leader
    replicas.leading          # this replica writes; the others forward every call but lookups to it
    replicas.run(stop, reap, refresh)   # the background thread: follow and campaign, then lead
    replicas.forward(method, target, body, headers) -> (status, payload)   # a follower's call to the leader

The leader is the replica holding a PostgreSQL advisory lock, on a connection of its own: when its
process dies the connection closes and the lock is free at once, and a follower that asks for it
every CAMPAIGN_S takes over. Leading means what one directory does alone: the one writer (group
commit), the page credit, save reservations, the reaper and every worker call. Each new leader
raises the term in `directory_leader`; every commit of its writer first checks that the term is
still its own, so a leader that lost its lock without knowing it cannot write after its successor
has begun.

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

from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.orm import Session

from kvstore.client.http import JsonHttp
from kvstore.core.errors import KVStoreError
from kvstore.directory import repository as repo
from kvstore.directory.models import Change, LeaderRow, Worker

log = logging.getLogger(__name__)
LOCK_KEY = 0x6B7673746F7265  # the advisory lock of the leader ("kvstore")
CHANNEL = "kvstore_changes"
CAMPAIGN_S = 0.5  # a follower asks for the lock this often, and reads the change log at least this often
RETENTION_S = 120.0  # changes are kept this long; a follower further behind rebuilds its index
BATCH = 1000  # changes read at once
COALESCE_S = 0.002  # after a notification, wait this long for more before reading the log


class Replicas:
    def __init__(self, service, engine: Engine, advertise_url: str | None, clock: Callable[[], float] = time.time):
        self._service = service
        self._engine = engine
        self._sessions = service.sessions
        self._clock = clock
        self.url = advertise_url or ""
        self.enabled = engine.dialect.name == "postgresql"
        self.leading = not self.enabled
        self.retired = ""  # why this replica stopped serving (it lost the lead); "" while it serves
        self.term = 0
        self.leader_url = self.url if self.leading else ""
        self.live_workers = 0  # a follower's count, from SQL (the leader counts heartbeats itself)
        self._last = 0  # the last change this replica's index has applied
        self._conn = None  # psycopg connection: holds the lock (leader), listens (follower)
        self._checkpoints: deque[tuple[float, int]] = deque()  # (when, highest change id then): pruning
        self._leader: JsonHttp | None = None
        self._leader_lock = threading.Lock()
        service.leading = self.leading

    # ---- the background thread ------------------------------------------------------------------

    def run(self, stop: threading.Event, reap: Callable[[], None], refresh: Callable[[], None]) -> None:
        """Follow and campaign until this replica leads (at once without PostgreSQL), then reap
        every tick. `refresh` runs every tick in both roles (credentials read again)."""
        if not self.enabled:
            self._service.start()
        else:
            self._connect()
            self._follow_start()
            while not self._campaign():
                self._follow(stop, CAMPAIGN_S)
                refresh()
                if stop.is_set():
                    return
            self._promote()
        while not stop.wait(self._service.settings.reaper_interval_s) and not self.retired:
            if self.enabled and not self._holds_lock():
                regained = self._regain()
                if regained is False:
                    self._retire("it lost the leader's lock (its database connection dropped) and another "
                                 "replica has led since")
                    return
                if regained is None:
                    continue  # the database does not answer: nothing to reap, nobody else can lead either
            reap()
            self._prune()
            refresh()

    def _connect(self, listen: bool = True) -> None:
        import psycopg  # the PostgreSQL driver: present wherever a postgresql+psycopg URL works

        url = self._engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._conn = psycopg.connect(url, autocommit=True)
        if listen:
            self._conn.execute(f"LISTEN {CHANNEL}")

    def _try_lock(self) -> bool:
        return self._conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]

    def _campaign(self) -> bool:
        """Take the lock if it is free; else learn who leads and how many workers live."""
        if self._try_lock():
            return True
        now = self._clock()
        with self._sessions() as session:
            leader = session.get(LeaderRow, 1)
            self._set_leader(leader.url if leader is not None else "")
            self.live_workers = session.scalar(select(func.count()).select_from(Worker).where(
                Worker.state != "dead", Worker.heartbeat_at >= now - self._service.settings.heartbeat_timeout_s))
        return False

    def _promote(self) -> None:
        """Raise the term (the old leader's writer can commit no more), apply what it committed
        last, then start as the one directory does: recover, page credit, reaper."""
        with self._sessions.begin() as session:
            self.term = session.execute(update(LeaderRow).where(LeaderRow.id == 1).values(
                term=LeaderRow.term + 1, url=self.url, since=self._clock()).returning(LeaderRow.term)).scalar_one()
        self._apply_changes()
        self._service.writer.before_commit = self._before_commit
        self._service.start(rebuild_index=False)
        self._conn.execute(f"UNLISTEN {CHANNEL}")
        self.leading = self._service.leading = True
        self._set_leader(self.url)
        log.info("this directory replica leads now (term %d)", self.term)

    def _holds_lock(self) -> bool:
        try:
            self._conn.execute("SELECT 1")
            return True
        except Exception:  # noqa: BLE001 (any failure of the lock's connection ends the lead)
            return False

    def _regain(self) -> bool | None:
        """After the lock's connection dropped: reconnect and take the lock again. True if this
        replica still leads (nobody raised the term meanwhile: a new leader's first write does),
        False if another replica leads or has led, None while the database cannot be reached."""
        try:
            self._conn.close()
        except Exception:  # noqa: BLE001 (already broken)
            pass
        try:
            self._connect(listen=False)
            if not self._try_lock():
                return False
            with self._sessions() as session:
                if session.scalar(select(LeaderRow.term).where(LeaderRow.id == 1)) != self.term:
                    return False
        except Exception as exc:  # noqa: BLE001 (the database is away: try again next tick)
            log.warning("the leader's lock connection is down, reconnecting: %s", exc)
            return None
        log.info("the leader's lock is held again (term %d)", self.term)
        return True

    def _retire(self, why: str) -> None:
        self.leading = self._service.leading = False
        self.retired = why
        log.critical("this directory replica stops serving: %s; restart it (it will follow the new leader)", why)

    # ---- the leader's commits ---------------------------------------------------------------------

    def _before_commit(self, session: Session, touched: set[int], topology: bool, namespaces: bool,
                       committed: list, handoffs: set[str]) -> None:
        """In each group's transaction: the term is still ours (else roll back and stop), and what
        the group changed is logged for the followers."""
        if self.retired or session.execute(update(LeaderRow).where(LeaderRow.id == 1, LeaderRow.term == self.term)
                                           .values(term=LeaderRow.term)).rowcount != 1:
            if not self.retired:
                self._retire(f"another replica leads now (this one led in term {self.term})")
            raise KVStoreError("unavailable", "this directory replica no longer leads; ask another")
        blocks = touched | {row[0] for row in committed}
        if blocks or topology or namespaces or handoffs:
            session.execute(insert(Change).values(at=self._clock(), blocks=",".join(map(str, sorted(blocks))),
                                                  topology=topology, namespaces=namespaces,
                                                  handoffs=",".join(sorted(handoffs))))
            session.execute(text(f"NOTIFY {CHANNEL}"))

    def _prune(self) -> None:
        """Changes older than RETENTION_S go (by id, found from a checkpoint taken back then)."""
        if not self.enabled:
            return
        now = self._clock()
        if not self._checkpoints or now - self._checkpoints[-1][0] >= RETENTION_S / 4:
            with self._sessions() as session:
                self._checkpoints.append((now, session.scalar(select(func.coalesce(func.max(Change.id), 0)))))
        if self._checkpoints[0][0] > now - RETENTION_S:
            return
        _, below = self._checkpoints.popleft()

        def job(tx) -> None:
            tx.session.execute(Change.__table__.delete().where(Change.id < below))
            tx.session.execute(update(LeaderRow).where(LeaderRow.id == 1).values(pruned_below=below))
        self._service.writer.run(job)

    # ---- following ----------------------------------------------------------------------------------

    def _follow_start(self) -> None:
        """The index from SQL; changes logged from here on are applied after it (again, harmlessly,
        if the rebuild already saw them)."""
        with self._sessions() as session:
            self._last = session.scalar(select(func.coalesce(func.max(Change.id), 0)))
        with self._sessions() as session:
            self._service.load_namespaces(session)
            self._service.index.rebuild(session)
            self._service.handoffs.learn_recent(session, self._clock())
        log.info("following the leader: index of %d blocks", self._service.index.num_blocks)

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
                pruned = session.scalar(select(LeaderRow.pruned_below).where(LeaderRow.id == 1)) or 0
                if self._last + 1 < pruned:  # what we missed is gone from the log
                    log.warning("this replica fell behind the change log; rebuilding its index")
                    self._follow_start()
                    continue
                rows = session.execute(select(Change.id, Change.blocks, Change.topology, Change.namespaces,
                                              Change.handoffs)
                                       .where(Change.id > self._last).order_by(Change.id).limit(BATCH)).all()
                if not rows:
                    return
                blocks = {int(b) for row in rows if row.blocks for b in row.blocks.split(",")}
                if any(row.topology for row in rows):
                    self._service.index.reload_topology(session)
                if blocks:
                    self._service.index.reload(session, blocks)
                if any(row.namespaces for row in rows):
                    self._service.load_namespaces(session)
                handoffs = [k for row in rows if row.handoffs for k in row.handoffs.split(",")]
                if handoffs:  # after the blocks: a waiter that hears of a hand-off finds its blocks
                    self._service.handoffs.learned(repo.handoff_rows(session, handoffs))
                self._last = rows[-1].id
            if len(rows) < BATCH:
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
            if self._leader is None and self.leader_url:
                self._leader = JsonHttp(self.leader_url, timeout_s=self._service.settings.move_timeout_s + 30,
                                        ca_file=self._service.settings.ca_file)
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
