"""Keeping a lease or a reservation alive while a long transfer runs.

    with Renewal(directory, token, ttl_s):   # renews every ttl_s / 3 until the block exits
        transfer()

A renewal the directory refuses for good (the token expired or was reclaimed: 409, 404) stops the
renewals and is remembered in `lost`; the completion that follows is then refused too, and the
caller treats the call as a miss, as it would for any expired token. A refusal that passes (429
over the token's rate, 503 while a replica restarts or the lead moves, or no directory reachable
for a moment) is asked again: after what its Retry-After says, else soon (a third of the usual
interval), so that one busy moment never costs the lease of a transfer longer than the TTL.
"""

from __future__ import annotations

import logging
import threading

from kvstore.core.errors import KVStoreError

log = logging.getLogger(__name__)
MIN_INTERVAL_S = 0.05
PASSING = ("throttled", "unavailable")  # refusals that say nothing of the token: ask again


class Renewal:
    def __init__(self, directory, token: str | None, ttl_s: float) -> None:
        self.directory, self.token = directory, token
        self.interval_s = max(MIN_INTERVAL_S, ttl_s / 3)
        self.renewals = 0
        self.retries = 0  # renewals asked again after a passing refusal
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-renewal", daemon=True)

    def __enter__(self) -> Renewal:
        if self.token is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        wait_s = self.interval_s
        while not self._stop.wait(wait_s):
            try:
                self.directory.renew(self.token)
                self.renewals, wait_s = self.renewals + 1, self.interval_s
            except KVStoreError as exc:
                if exc.kind not in PASSING:
                    self.lost = f"{exc.kind}: {exc.message}"  # the token is a capability: never logged whole
                    log.warning("could not renew %s…: %s", self.token[:8], self.lost)
                    return
                self.retries += 1
                wait_s = self._again_after(exc)
                log.info("renewal of %s… refused for now (%s): asked again in %.2f s", self.token[:8], exc.kind,
                         wait_s)

    def _again_after(self, exc: KVStoreError) -> float:
        """What the directory's Retry-After asks for, else a third of the interval."""
        asked = exc.context.get("retry_after_s")
        if isinstance(asked, (int, float)) and asked > 0:
            return max(MIN_INTERVAL_S, float(asked))
        return max(MIN_INTERVAL_S, self.interval_s / 3)
