"""The directory's calls to storage workers, made outside every job (never inside a transaction).

    calls.grant(url, kind, token, max_pages) -> runs   # page credit for a memory tier
    calls.move(url, items) -> MoveResult                # a worker that cannot be reached failed them all
    calls.verify(url, replicas) -> [bool | None]        # do replicas still hash to their checksums?
    calls.fence(url, tokens) -> [bool] | None           # has every move under these tokens stopped there?
    calls.free_later(url, items) -> callable            # for Tx.after_commit: give pages back / delete objects,
                                                        # on a background thread, in order
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pydantic import ValidationError

from kvstore.client.worker import WorkerControlClient
from kvstore.core import moving, page_calls, specs
from kvstore.core.errors import KVStoreError

log = logging.getLogger(__name__)


PROBE_S = 1.0  # a live worker answers /healthz within this


class WorkerCalls:
    def __init__(self, timeout_s: float = 10.0, move_timeout_s: float = 300.0, ca_file: str | None = None) -> None:
        self._timeout_s = timeout_s
        self._ca_file = ca_file  # workers' HTTPS certificates are checked against it
        self._secrets: dict[str, str | None] = {}  # control URL -> the secret its worker registered with
        self.move_timeout_s = move_timeout_s  # a batch of NVMe or S3 copies; its destinations expire after it
        self._clients: dict[str, WorkerControlClient] = {}
        self._lock = threading.Lock()
        # frees run after the commit that forgot the pages, never on the writer: a worker whose S3
        # endpoint is down can take seconds per deleted object
        self._frees = ThreadPoolExecutor(1, thread_name_prefix="worker-frees")

    def authorize(self, url: str, secret: str | None) -> None:
        """Calls to `url` carry `secret` from now on (a worker registered, or the directory started)."""
        with self._lock:
            if url in self._secrets and self._secrets[url] == secret:
                return
            self._secrets[url] = secret
            old = self._clients.pop(url, None)
        if old is not None:
            old.close()

    def secret(self, url: str) -> str | None:
        """The secret the worker at `url` registered with (it signs the worker's push grants)."""
        with self._lock:
            return self._secrets.get(url)

    def client(self, url: str) -> WorkerControlClient:
        with self._lock:
            if url not in self._clients:
                self._clients[url] = WorkerControlClient(url, timeout_s=self._timeout_s, token=self._secrets.get(url),
                                                         ca_file=self._ca_file)
            return self._clients[url]

    def answers(self, url: str, timeout_s: float = PROBE_S) -> bool:
        """Whether a worker's control endpoint answers /healthz now."""
        probe = WorkerControlClient(url, timeout_s=timeout_s, ca_file=self._ca_file)
        try:
            probe.call_raw("GET", "/healthz")
            return True
        except KVStoreError:
            return False
        finally:
            probe.close()

    def grant(self, url: str, kind: str, token: str, max_pages: int) -> list[specs.PageRun]:
        return self.client(url).grant(page_calls.GrantRequest(token=token, kind=kind, max_pages=max_pages)).runs

    def move(self, url: str, items: list[moving.MoveItem], deadline: float,
             peer: moving.Peer | None = None, timeout_s: float | None = None) -> moving.MoveResult:
        """The worker must not start after `deadline` (unix time) nor wait past it; we wait for its
        answer until a little after (`timeout_s`, the deadline from now: the move timeout unless
        given). No answer: every item is `unreachable` (outcome unknown). `peer`: the items go into
        that worker's DRAM."""
        wait_s = timeout_s or self.move_timeout_s
        try:
            return self.client(url).move(moving.MoveRequest(items=items, expires_at=deadline, peer=peer),
                                         timeout_s=wait_s + min(5.0, wait_s / 2))
        except (KVStoreError, ValidationError) as exc:  # no answer, or one that cannot be read: outcome unknown
            return moving.MoveResult(ok=[False] * len(items), errors=[str(exc)] * len(items),
                                    codes=["unreachable"] * len(items))

    def verify(self, url: str, replicas: list[tuple]) -> list[bool | None]:
        """Per replica (tier kind, page runs, nbytes, checksum), whether the worker found its bytes
        intact; None when it could not say."""
        items = [moving.VerifyItem(kind=kind, runs=[_page_run(r) for r in runs], nbytes=nbytes, checksum=checksum)
                 for kind, runs, nbytes, checksum in replicas]
        try:
            return self.client(url).verify(moving.VerifyRequest(items=items)).matches
        except KVStoreError as exc:
            log.warning("verifying %d replicas on %s failed: %s", len(items), url, exc)
            return [None] * len(items)

    def fence(self, url: str, tokens: list[str]) -> list[bool] | None:
        """Per move token, whether the worker says nothing writes under it any more (and it will refuse
        a move under it from now on); None when the worker did not answer."""
        try:
            return self.client(url).fence(moving.FenceRequest(tokens=tokens), timeout_s=PROBE_S * 2).settled
        except KVStoreError as exc:
            log.debug("fencing %d moves on %s failed: %s", len(tokens), url, exc)
            return None

    def free_later(self, url: str, items: list[tuple]) -> Callable[[], None]:
        """A call giving (token, page runs[, object name[, all pages]]) back to the worker; runs are
        PageRuns or [first, count]; an object name (s3) means: delete that object; all pages: every
        NVMe page the token holds there."""
        def free() -> None:
            for start in range(0, len(items), page_calls.MAX_FREE_ITEMS):
                chunk = items[start : start + page_calls.MAX_FREE_ITEMS]
                body = page_calls.FreeRequest(items=[
                    page_calls.FreeItem(token=i[0], runs=[_page_run(r) for r in i[1]],
                                        object=i[2] if len(i) > 2 else None, all_pages=len(i) > 3 and i[3])
                    for i in chunk])
                try:
                    self.client(url).free(body)
                except KVStoreError as exc:  # a worker that is gone keeps nothing: its epoch resets its pages
                    log.warning("giving %d allocations back to %s failed: %s", len(chunk), url, exc)
                    return
        return (lambda: self._frees.submit(free)) if items else (lambda: None)

    def settle(self) -> None:
        """Wait for the frees handed out so far (tests, shutdown)."""
        self._frees.submit(lambda: None).result()

    def close(self) -> None:
        self._frees.shutdown(wait=True)
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def _page_run(run) -> specs.PageRun:
    return run if isinstance(run, specs.PageRun) else specs.PageRun(first=run[0], count=run[1])
