"""This replica's role among directory replicas on one database: whether it leads, under which
term, why it stopped, how far behind a follower is. The election (`replica/leader.py`) sets it; the
commit check (`db/changelog.py`), the service, hand-offs and operators' calls read it.

    role = Role(alone)               # alone (one directory on SQLite): it leads from the start
    role.lead(term)                  # promoted: its commits are checked against `term` from now on
    role.lose(why)                   # no longer leads; its commits are refused
    role.followed()                  # a follower read the change log
    role.leading / role.term / role.lost / role.checks / role.lag_s
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Role:
    def __init__(self, alone: bool = True) -> None:
        self.leading = alone
        self.term = 0
        self.lost = ""  # why this replica stopped leading (another took over); "" until then and once it leads
        self.checks = False  # from its promotion on, a leader checks its term in every commit
        self._followed_at = time.monotonic()  # a follower last read the change log then

    def lead(self, term: int) -> None:
        self.term = term
        self.checks = True
        self.lost = ""

    def lose(self, why: str) -> None:
        """This replica no longer leads. Its commits are refused from here on (another replica may
        lead under a higher term); `leader.Leader` makes it follow again, from SQL."""
        self.leading = False
        if not self.lost:
            log.warning("this directory replica no longer leads: %s; it follows again", why)
        self.lost = why

    def followed(self) -> None:
        """A follower read the change log (whatever it found)."""
        self._followed_at = time.monotonic()

    @property
    def lag_s(self) -> float:
        """Seconds since this follower last read the change log; 0 on the leader."""
        return 0.0 if self.leading else time.monotonic() - self._followed_at
