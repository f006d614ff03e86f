"""Moves nobody waits on: their destinations go back as soon as the worker executing them has stopped.

    orphans.settle() -> n    # the reaper: WRITING destinations of moves this process does not wait on

A move's destination is WRITING until the move answers. When the answer is lost (the leader that
sent the move died, or the call to the worker timed out), the worker may still be writing, so the
destination is held until the move's deadline (`move_timeout_s`, minutes by default): a drain or
an operator waits that long for those pages. The worker that executes the move can say sooner:
`POST /v1/fence` answers, per token, whether nothing writes under it there any more, and from then
on that worker refuses a move under it (one the dead leader sent that arrives late). Those
destinations are dropped and their pages given back; the source stays where it was, since a move
never takes its source away before the copy counts.

An executor that is dead cannot be asked. Destinations on its own tiers are dropped at once:
nothing else writes there, and it comes back in a new epoch. What it was copying into another
worker's DRAM stays until the move's deadline: a worker declared dead may only be cut off from
the directory, and still writing.
"""

from __future__ import annotations

import logging
import time

from kvstore.directory.db import moves as sql
from kvstore.directory.db import repository as repo
from kvstore.directory.db.models.replica import WRITING
from kvstore.directory.moves.move import Moves, move_executor
from kvstore.directory.workers.reclaim import Reclaim
from kvstore.directory.workers.calls import WorkerCalls
from kvstore.directory.db.writer import Tx, Write

log = logging.getLogger(__name__)
RETRY_S = 5.0  # a worker that did not answer a fence is asked again after this


class Orphans:
    def __init__(self, write: Write, moves: Moves, calls: WorkerCalls, reclaim: Reclaim) -> None:
        self._write = write
        self._moves = moves
        self._calls = calls
        self._reclaim = reclaim
        self._retry_at: dict[str, float] = {}  # control URL -> when to ask it again

    def settle(self) -> int:
        # the rows first, then the moves waited on: a move that reserves in between is waited on
        found = self._write(lambda tx: sql.move_destinations(tx.session))
        if not found:
            return 0
        waiting = self._moves.waiting()
        orphans: dict[tuple[str, int], set[int]] = {}  # (token, its executor) -> the destinations' workers
        for token, worker_id in found:
            executor = move_executor(token)
            if token not in waiting and executor is not None:
                orphans.setdefault((token, executor), set()).add(worker_id)
        if not orphans:
            return 0
        workers = self._write(lambda tx: {w.id: (w.state, w.control_url) for w in repo.workers(tx.session)})
        settled, asked = [], {}
        for (token, executor), dests in orphans.items():
            state, url = workers.get(executor, ("gone", ""))
            if state == "dead" and dests == {executor}:
                settled.append(token)  # its own tiers: nobody else writes there
            elif state not in ("dead", "gone") and self._retry_at.get(url, 0.0) <= time.monotonic():
                asked.setdefault(url, []).append(token)
        for url, tokens in asked.items():
            answer = self._calls.fence(url, tokens)
            if answer is None:
                self._retry_at[url] = time.monotonic() + RETRY_S
                continue
            self._retry_at.pop(url, None)
            settled += [token for token, done in zip(tokens, answer) if done]
        dropped = self._write(lambda tx: self._drop(tx, settled)) if settled else 0
        if dropped:
            log.info("gave back %d destinations of %d moves whose answer was lost", dropped, len(settled))
        return dropped

    def _drop(self, tx: Tx, tokens: list[str]) -> int:
        rows = [(r, t, w) for token in tokens for r, _, t, w in repo.replicas_with_token(tx.session, token, WRITING)]
        self._reclaim.drop(tx, rows)
        return len(rows)
