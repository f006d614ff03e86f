"""Which workers' NIXL metadata this connector holds, by (worker, epoch).

A worker that restarts comes back under a new epoch (and a new agent name):
its old metadata is dropped (`remove_remote_agent`) and the new one loaded.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading

from kvstore.client import DirectoryClient
from kvstore.core.errors import KVStoreError
from kvstore.transfer import Agent

log = logging.getLogger(__name__)


class Peers:
    def __init__(self, agent: Agent, directory: DirectoryClient) -> None:
        self._agent = agent
        self._directory = directory
        self._known: dict[str, tuple[int, str]] = {}  # worker -> (epoch, agent name)
        self._lock = threading.Lock()  # the vLLM connector asks from its saver and poller threads too

    def agent_for(self, worker: str, epoch: int) -> str | None:
        """The NIXL agent name to address `worker` at `epoch`, or None if it is not that epoch."""
        with self._lock:
            return self._agent_for(worker, epoch)

    def _agent_for(self, worker: str, epoch: int) -> str | None:
        known = self._known.get(worker)
        if known and known[0] == epoch:
            return known[1]
        try:
            info = self._directory.worker(worker)
        except KVStoreError as exc:
            log.warning("cannot fetch metadata of worker %s: %s", worker, exc)
            return None
        if info.epoch != epoch or info.state == "dead" or not info.agent_metadata:
            return None
        if known:
            self._agent.remove_peer(known[1])
            del self._known[worker]
        try:
            name = self._agent.add_peer(base64.b64decode(info.agent_metadata))
        except KVStoreError as exc:  # not dead to the directory yet, but unreachable: asked again next time
            log.warning("worker %s cannot be reached over NIXL: %s", worker, exc)
            return None
        self._known[worker] = (epoch, name)
        return name

    def close(self) -> None:
        for _, name in self._known.values():
            self._agent.remove_peer(name)
        self._known.clear()


LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_HOSTS = 16


def own_hosts(extra=()) -> list[str]:
    """What the workers on this engine's host may have registered as their address: `extra` (an
    address only the operator knows, e.g. a Kubernetes node's), the host's names, the addresses
    they resolve to, and loopback. Sent with every save, so that the directory puts blocks on a
    worker of this host when one has room."""
    names = [*extra, socket.gethostname(), socket.getfqdn()]
    try:
        names += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)]
    except OSError:  # a host name that does not resolve: names and loopback still count
        pass
    return list(dict.fromkeys(n for n in [*names, *LOOPBACK] if n))[:MAX_HOSTS]
