"""Keeping a lease or a reservation alive while a long transfer runs.

    with Renewal(directory, token, ttl_s):   # renews every ttl_s / 3 until the block exits
        transfer()

A renewal the directory refuses (the token expired or was reclaimed) stops the renewals and is
remembered in `lost`; the completion that follows is then refused too, and the caller treats
the call as a miss, as it would for any expired token.
"""

from __future__ import annotations

import logging
import threading

from kvstore.core.errors import KVStoreError

log = logging.getLogger(__name__)
MIN_INTERVAL_S = 0.05


class Renewal:
    def __init__(self, directory, token: str | None, ttl_s: float) -> None:
        self.directory, self.token = directory, token
        self.interval_s = max(MIN_INTERVAL_S, ttl_s / 3)
        self.renewals = 0
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
        while not self._stop.wait(self.interval_s):
            try:
                self.directory.renew(self.token)
                self.renewals += 1
            except KVStoreError as exc:
                self.lost = f"{exc.kind}: {exc.message}"  # the token is a capability: never logged whole
                log.warning("could not renew %s…: %s", self.token[:8], self.lost)
                return
