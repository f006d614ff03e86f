"""The DRAM arena handed to same-host engines over a Unix socket: the worker's side keeps serving
through accept() errors, never takes a live worker's socket, and refuses engines past its limit;
the engine's side maps one worker without holding up the others."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvstore.connector import arenas as arena_module
from kvstore.connector.arenas import LocalArenas
from kvstore.core import specs
from kvstore.core.memory import HostBuffer
from kvstore.worker import sharing
from kvstore.worker.sharing import ArenaShare
from tests.helpers import wait_until


def location(worker: str = "w0", epoch: int = 1, agent: str = "agent-1") -> specs.ReplicaLocation:
    return specs.ReplicaLocation(worker=worker, epoch=epoch, agent_name=agent, tier="dram", runs=[])


@pytest.fixture
def folder(tmp_path) -> Path:
    return tmp_path / "arenas"


def shared(folder: Path, name: str = "w0", epoch: int = 1, agent: str = "agent-1", **options) -> ArenaShare:
    share = ArenaShare(folder / f"{name}.sock", HostBuffer(1 << 20, shared=True),
                       lambda: {"agent_name": agent, "epoch": epoch}, **options)
    share.start()
    return share


def test_a_second_worker_of_the_same_name_leaves_the_live_workers_socket_alone(folder):
    live = shared(folder, agent="live")
    arenas = LocalArenas(str(folder))
    try:
        with pytest.raises(FileExistsError):
            shared(folder, agent="impostor")
        arena = arenas.view(location(agent="live"))
        assert arena is not None and arena.agent_name == "live"
    finally:
        arenas.close()
        live.stop()
    stale = socket.socket(socket.AF_UNIX)  # a dead worker's socket file: nobody serves it
    stale.bind(str(folder / "w1.sock"))
    stale.close()
    successor = shared(folder, name="w1", agent="next")
    arenas = LocalArenas(str(folder))
    try:
        assert arenas.view(location("w1", agent="next")) is not None
    finally:
        arenas.close()
        successor.stop()


CHILD = """
import os, resource, sys, time
from pathlib import Path
from kvstore.core.memory import HostBuffer
from kvstore.worker.sharing import ArenaShare
errors = []
share = ArenaShare(Path(sys.argv[1]), HostBuffer(1 << 20, shared=True), lambda: {"agent_name": "a", "epoch": 1},
                   errors.append)
share.start()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
lowest = os.dup(0)
os.close(lowest)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # every descriptor number is taken: accept() fails
print("limited", flush=True)
while len(errors) < 3:
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("restored", errors[0], flush=True)
sys.stdin.read()
"""


def test_the_arena_is_still_handed_over_after_accept_fails_for_lack_of_descriptors(folder):
    """EMFILE from accept() (counted each time) does not end the sharing: once descriptors are
    free again, the engine that waited gets the arena."""
    folder.mkdir(mode=0o700)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder / "w0.sock")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "limited"
        engine = socket.socket(socket.AF_UNIX)
        engine.settimeout(60)
        engine.connect(str(folder / "w0.sock"))  # queued: the worker cannot accept it yet
        assert child.stdout.readline().split() == ["restored", "accept"]
        message, fds, _, _ = socket.recv_fds(engine, 4096, 1)
        assert len(fds) == 1 and json.loads(message)["agent_name"] == "a"
        engine.close()
    finally:
        child.kill()
        child.wait(30)


def test_an_engine_past_the_limit_is_refused_once_and_carried_by_nixl_not_mapped_per_call(folder, monkeypatch):
    monkeypatch.setattr(sharing, "MAX_ENGINES", 1)
    errors: list[str] = []
    share = shared(folder, on_error=errors.append)
    first, second = LocalArenas(str(folder)), LocalArenas(str(folder))
    try:
        assert first.view(location()) is not None
        wait_until(lambda: len(share._engines) == 1, 10, "the first engine held")
        assert second.view(location()) is None and second.view(location()) is None
        assert errors == ["too_many_engines"]  # asked once: not again before arenas.RETRY_S
        assert first.view(location()) is not None
    finally:
        first.close()
        second.close()
        share.stop()


def test_a_slow_workers_hand_over_holds_up_no_other_workers_copies(folder, monkeypatch):
    monkeypatch.setattr(arena_module, "HANDOVER_TIMEOUT_S", 60.0)
    fast = shared(folder, name="fast")
    slow = socket.socket(socket.AF_UNIX)  # accepts an engine, then says nothing
    slow.bind(str(folder / "slow.sock"))
    slow.listen(1)
    arenas, conn = LocalArenas(str(folder)), None
    stuck = threading.Thread(target=arenas.view, args=(location("slow"),), daemon=True)
    try:
        assert arenas.view(location("fast")) is not None
        stuck.start()
        conn, _ = slow.accept()  # the slow hand-over is under way
        later = shared(folder, name="later")
        got: list = []
        other = threading.Thread(target=lambda: got.extend([arenas.view(location("fast")),
                                                            arenas.view(location("later"))]))
        other.start()
        other.join(30)
        assert len(got) == 2 and None not in got and stuck.is_alive()
        later.stop()
    finally:
        if conn is not None:
            conn.close()
        slow.close()
        stuck.join(30)
        arenas.close()
        fast.stop()


def test_a_location_of_a_workers_past_life_leaves_the_mapping_of_its_present_one(folder):
    share = shared(folder, epoch=3, agent="now")
    arenas = LocalArenas(str(folder))
    try:
        mapped = arenas.view(location(epoch=3, agent="now"))
        assert mapped is not None
        assert arenas.view(location(epoch=2, agent="before")) is None
        assert arenas.view(location(epoch=3, agent="now")) is mapped  # neither dropped nor mapped again
    finally:
        arenas.close()
        share.stop()
