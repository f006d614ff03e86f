"""Hand-offs on the engine side: a consumer waits for a producer's KV, up to a deadline.

    wait_for_handoff(directory, namespace_id, handoff_id, hashes, deadline) -> HandoffResult
    waits = HandoffWaits(directory)              # the vLLM scheduler's: waits on threads of their own
    waits.start(req_id, namespace_id, handoff_id, hashes, timeout_s)
    waits.result(req_id) -> HandoffResult | None # None while it waits
    waits.cancel(req_id)                         # the request went away
    waits.close()

A wait never raises for a hand-off that does not come: its deadline passes (`timeout`), and the
consumer loads what is there and computes the rest. A directory that cannot be reached, or that
has too many waits open, is asked again until the deadline; an answer that says the request
itself is wrong (a malformed id, a namespace the consumer may not use) ends the wait at once
(`error`). Deadlines are set when a wait is asked for, so a wait that queued for a thread does not
wait longer; a cancelled wait stops within CANCEL_POLL_S.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.client import DirectoryClient
from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import MAX_WAIT_S, HandoffWait

log = logging.getLogger(__name__)
RETRY_S = 0.2  # after the directory could not be reached
MAX_THREADS = 32  # consumer waits at once; more queue for a thread (their deadlines still hold)
CANCEL_POLL_S = 2.0  # a cancellable wait asks the directory at least this often
RETRIED = ("unavailable", "throttled")


@dataclass(frozen=True)
class HandoffResult:
    outcome: str  # committed / failed / present (the blocks are there) / timeout / error / cancelled
    waited_s: float
    num_tokens: int | None = None
    detail: str = ""


def wait_for_handoff(directory: DirectoryClient, namespace_id: str, handoff_id: str, hashes: list[str],
                     deadline: float, cancelled: threading.Event | None = None,
                     started: float | None = None) -> HandoffResult:
    """Until the hand-off is known, every block of `hashes` is stored, or `deadline` (monotonic)."""
    started = time.monotonic() if started is None else started
    poll_s = CANCEL_POLL_S if cancelled is not None else MAX_WAIT_S
    while True:
        if cancelled is not None and cancelled.is_set():
            return HandoffResult("cancelled", time.monotonic() - started)
        left = deadline - time.monotonic()
        try:
            state = directory.wait_handoff(HandoffWait(namespace_id=namespace_id, handoff_id=handoff_id,
                                                       hashes=hashes, timeout_s=max(0.0, min(left, poll_s))))
        except KVStoreError as exc:
            if exc.kind not in RETRIED:
                return HandoffResult("error", time.monotonic() - started, detail=str(exc))
            state = None  # the directory asks for patience: as long as it says, give or take a fifth
            asked = exc.context.get("retry_after_s")
            pause = max(RETRY_S, min(MAX_WAIT_S, asked) if isinstance(asked, (int, float)) else 0.0)
            pause *= random.uniform(0.8, 1.2)
            time.sleep(min(pause, max(0.0, left)))
        except ValueError as exc:  # a handoff id the directory would refuse: the request itself is wrong
            return HandoffResult("error", time.monotonic() - started, detail=str(exc))
        if state is not None and state.state != "pending":
            return HandoffResult(state.state, time.monotonic() - started, state.num_tokens)
        if time.monotonic() >= deadline:
            return HandoffResult("timeout", time.monotonic() - started)


class HandoffWaits:
    def __init__(self, directory: DirectoryClient, max_threads: int = MAX_THREADS) -> None:
        self._directory = directory
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="kvstore-handoff")
        self._waits: dict[str, tuple[Future, threading.Event]] = {}
        self._lock = threading.Lock()

    def start(self, req_id: str, namespace_id: str, handoff_id: str, hashes: list[str], timeout_s: float) -> None:
        cancelled, now = threading.Event(), time.monotonic()
        future = self._pool.submit(wait_for_handoff, self._directory, namespace_id, handoff_id, hashes,
                                   now + timeout_s, cancelled, now)
        with self._lock:
            self._waits[req_id] = (future, cancelled)

    def result(self, req_id: str) -> HandoffResult | None:
        """The wait's result once it ended (and forgets the wait), else None."""
        with self._lock:
            future, _ = self._waits.get(req_id, (None, None))
            if future is None or not future.done():
                return None
            del self._waits[req_id]
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 (a bug in a wait costs that request its hand-off, not the engine)
            log.exception("waiting for the hand-off of %s failed", req_id)
            return HandoffResult("error", 0.0, detail=type(exc).__name__)

    def cancel(self, req_id: str) -> None:
        with self._lock:
            future, cancelled = self._waits.pop(req_id, (None, None))
        if cancelled is not None:
            cancelled.set()

    def close(self) -> None:
        with self._lock:
            for _, cancelled in self._waits.values():
                cancelled.set()
            self._waits.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
