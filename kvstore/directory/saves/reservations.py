"""Save reservations: the pages a writer holds between prepare_store and complete_store, in memory.

    reservations.add(reservation)
    reservations.take(token) -> Reservation | None   # for complete/abort: taken until popped or put back
    reservations.pop(token) -> Reservation | None
    reservations.writer_of(namespace_id, hash) -> Reservation | None   # who is writing that block
    reservations.expired(now) -> [Reservation]                          # removed
    reservations.clear()
    reservations.reserved_bytes(tier_id), reservations.blocks

SQL first hears of a saved block when complete_store commits it READY with its
checksum, in one job: a save costs one commit, not two. Keeping reservations
out of SQL loses nothing: a directory that restarts rolls back every open
reservation anyway (its writers got no answer they can trust), and its page
credit is rebuilt as grants minus the pages that committed replicas hold,
which gives reserved pages back.

Saves add them under the store's lock; the writer's jobs end them (undoing
that if their group does not commit). Every change holds `Reservations`' own
lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple


class Reserved(NamedTuple):
    hash: str
    parent: str | None
    nbytes: int
    runs: list  # [(first page, count), ...]


@dataclass
class Reservation:
    token: str
    namespace_id: str
    tier_id: int
    worker_id: int
    epoch: int  # the worker's, when the pages were handed out
    page_bytes: int
    expires_at: float
    blocks: list[Reserved]
    taken: bool = False  # a complete or an abort is committing it: its blocks stay "being written"

    def bytes_of(self, blocks: list[Reserved]) -> int:
        return sum(count for block in blocks for _, count in block.runs) * self.page_bytes


class Reservations:
    def __init__(self) -> None:
        self._by_token: dict[str, Reservation] = {}
        self._writing: dict[tuple[str, str], Reservation] = {}  # (namespace, hash) -> its reservation
        self._bytes: dict[int, int] = {}  # tier id -> bytes reserved
        self.blocks = 0  # being written
        self._lock = threading.Lock()

    def add(self, r: Reservation) -> None:
        with self._lock:
            self._add(r)

    def _add(self, r: Reservation) -> None:
        self._by_token[r.token] = r
        for block in r.blocks:
            self._writing[(r.namespace_id, block.hash)] = r
        self._bytes[r.tier_id] = self._bytes.get(r.tier_id, 0) + r.bytes_of(r.blocks)
        self.blocks += len(r.blocks)

    def clear(self) -> None:
        with self._lock:
            self._by_token, self._writing, self._bytes, self.blocks = {}, {}, {}, 0

    def get(self, token: str) -> Reservation | None:
        r = self._by_token.get(token)
        return r if r is not None and not r.taken else None

    def take(self, token: str) -> Reservation | None:
        """The reservation, for a job that ends it: it is popped once the job's group has committed
        (until then a save of the same blocks still finds them being written), or given back with
        `untake` if the group fails. None if unknown or already taken."""
        with self._lock:
            r = self.get(token)
            if r is not None:
                r.taken = True
            return r

    def untake(self, r: Reservation) -> None:
        r.taken = False

    def pop(self, token: str) -> Reservation | None:
        with self._lock:
            return self._pop(token)

    def _pop(self, token: str) -> Reservation | None:
        r = self._by_token.pop(token, None)
        if r is not None:
            for block in r.blocks:
                if self._writing.get((r.namespace_id, block.hash)) is r:
                    del self._writing[(r.namespace_id, block.hash)]
            self._bytes[r.tier_id] -= r.bytes_of(r.blocks)
            self.blocks -= len(r.blocks)
        return r

    def writer_of(self, namespace_id: str, block_hash: str) -> Reservation | None:
        return self._writing.get((namespace_id, block_hash))

    def expired(self, now: float) -> list[Reservation]:
        """Reservations past their expiry, removed (a scan of the open ones: a few per engine)."""
        with self._lock:
            return [self._pop(r.token) for r in list(self._by_token.values()) if r.expires_at < now and not r.taken]

    def reserved_bytes(self, tier_id: int) -> int:
        return self._bytes.get(tier_id, 0)
