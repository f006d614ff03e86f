"""Renewal: a lease or reservation kept alive through throttling and a leader change; given up
only when the directory says the token is gone."""

from __future__ import annotations

import threading
import time

from kvstore.connector.renewal import Renewal
from kvstore.core.errors import KVStoreError, Unreachable


class Directory:
    """Answers renewals in the order given (None: renewed), then renews; records when each came."""

    def __init__(self, *answers: KVStoreError | None) -> None:
        self.answers, self.at = list(answers), []
        self.enough = threading.Event()

    def renew(self, token: str) -> None:
        self.at.append(time.monotonic())
        answer = self.answers.pop(0) if self.answers else None
        if len(self.at) >= 6:
            self.enough.set()
        if answer is not None:
            raise answer


def test_renewals_go_on_through_throttling_and_a_leader_change_honouring_retry_after():
    directory = Directory(KVStoreError("throttled", "over the rate", retry_after_s=1.5),
                          KVStoreError("unavailable", "this replica no longer leads; ask another"),
                          Unreachable("no directory answers"), None)
    with Renewal(directory, "t" * 32, ttl_s=1.5) as renewal:  # every 0.5 s
        assert directory.enough.wait(30)
    assert renewal.lost is None and renewal.retries == 3 and renewal.renewals >= 3
    assert directory.at[1] - directory.at[0] >= 1.5  # what Retry-After asked for
    assert directory.at[2] - directory.at[1] < 0.5  # a 503 without it: asked again before the interval


def test_a_token_the_directory_says_is_gone_stops_the_renewals():
    directory = Directory(None, KVStoreError("conflict", "unknown or expired lease token"))
    with Renewal(directory, "t" * 32, ttl_s=0.15) as renewal:
        deadline = time.monotonic() + 30
        while renewal.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # six intervals more: none is asked
    assert renewal.lost.startswith("conflict") and len(directory.at) == 2 and renewal.renewals == 1
