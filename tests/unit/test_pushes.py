"""The worker's side of pushed loads with an in-process agent: who may register which metadata,
how many pushes run at once, and what a push that does not finish leaves behind."""

from __future__ import annotations

import base64
import struct
import threading

import pytest

from kvstore.core import push
from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.worker import pushes
from kvstore.worker.pushes import Pushes, agent_name

SECRET, WORKER, EPOCH, TENANT, READER = "s" * 43, "w0", 3, "t", "kvstore-client-e1"


def blob(name: str) -> bytes:
    return b"nixlSerDes|Agent" + struct.pack("<Q", len(name)) + name.encode() + b"|Conns\x08rest"


class FakeTransfer:
    def __init__(self, state: str, gate: threading.Event | None) -> None:
        self.state, self.gate, self.error = state, gate, None if state == "done" else "timed out"

    def wait(self, _timeout_s: float) -> str:
        if self.gate is not None:
            self.gate.wait(10)
        return self.state


class FakeAgent:
    def __init__(self) -> None:
        self.peers: set[str] = {"w1-0123abcd"}  # a peer worker of the moves
        self.writes: list[tuple] = []
        self.state, self.gate = "done", None

    def has_peer(self, name: str) -> bool:
        return name in self.peers

    def add_peer(self, metadata: bytes) -> str:
        name = agent_name(metadata)
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def submit(self, op, local, remote, peer):
        self.writes.append((op, local.tolist(), remote.tolist(), peer))
        return FakeTransfer(self.state, self.gate)


@pytest.fixture
def worker():
    arena = HostBuffer(1 << 20)
    agent = FakeAgent()
    return Pushes(agent, arena, lambda: (WORKER, EPOCH, SECRET)), agent, arena


def request(arena: HostBuffer, reader: str = READER, generation: int = 1, metadata: str | None = None,
            **changes) -> push.PushRequest:
    runs = [(arena.addr, 4096), (arena.addr + 8192, 4096)]
    fields = dict(tenant=TENANT, reader=reader, epoch=EPOCH, token="tok", expires_at=4e9, runs=runs,
                  grant=push.lease_grant(SECRET, WORKER, EPOCH, TENANT, reader, "tok", 4e9, runs),
                  engine_key=push.engine_key(SECRET, WORKER, EPOCH, TENANT, reader), items=[(1, 1 << 40)],
                  engine=push.EngineMemory(generation=generation, metadata=metadata))
    return push.PushRequest(**{**fields, **changes})


def metadata(name: str) -> str:
    return base64.b64encode(blob(name)).decode()


def test_the_agent_a_metadata_blob_names():
    assert agent_name(blob("kvstore-client-e1")) == "kvstore-client-e1"
    assert agent_name(b"nixlSerDes|Agent" + struct.pack("<Q", 1 << 40) + b"x") is None
    assert agent_name(b"something else") is None


def test_a_push_writes_the_granted_runs_once_the_worker_has_the_engine_s_metadata(worker):
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena)).code == "metadata"  # a first push without it
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    assert agent.writes == [("WRITE", [[arena.addr + 8192, 4096]], [[1 << 40, 4096]], READER)]
    assert pushes_.push(request(arena)).code == "ok"  # kept
    assert pushes_.push(request(arena, generation=0)).code == "stale"


def test_metadata_must_name_the_reader_and_no_agent_the_worker_talks_to_already(worker):
    pushes_, agent, arena = worker
    with pytest.raises(KVStoreError) as refused:
        pushes_.push(request(arena, metadata=metadata("kvstore-client-someone-else")))
    assert refused.value.kind == "invalid"
    with pytest.raises(KVStoreError) as refused:
        pushes_.push(request(arena, reader="w1-0123abcd", metadata=metadata("w1-0123abcd")))
    assert refused.value.kind == "forbidden" and not agent.writes


@pytest.mark.parametrize("change", [{"token": "another"}, {"expires_at": 5e9}, {"epoch": EPOCH + 1},
                                    {"tenant": "other"}, {"runs": [(1, 4096), (2, 4096)]}])
def test_a_push_the_directory_did_not_sign_is_forbidden(worker, change):
    pushes_, agent, arena = worker
    with pytest.raises(KVStoreError) as refused:
        pushes_.push(request(arena, metadata=metadata(READER), **change))
    assert refused.value.kind == "forbidden" and not agent.writes


def test_runs_outside_the_arena_are_refused_even_when_signed(worker):
    pushes_, agent, arena = worker
    runs = [(arena.addr + arena.nbytes, 4096)]
    body = request(arena, metadata=metadata(READER), runs=runs, items=[(0, 1 << 40)],
                   grant=push.lease_grant(SECRET, WORKER, EPOCH, TENANT, READER, "tok", 4e9, runs))
    with pytest.raises(KVStoreError) as refused:
        pushes_.push(body)
    assert refused.value.kind == "invalid" and not agent.writes


def test_a_push_that_does_not_finish_cuts_the_engine_off_until_it_registers_again(worker):
    pushes_, agent, arena = worker
    agent.state = "failed"
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "failed"
    assert READER not in agent.peers  # its connection is closed: the request cannot land later
    agent.state = "done"
    assert pushes_.push(request(arena)).code == "metadata"


def test_forget_refuses_older_generations_and_waits_for_running_pushes(worker):
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    agent.gate = threading.Event()
    running = threading.Thread(target=lambda: pushes_.push(request(arena)))
    running.start()
    forgot = []
    forgetting = threading.Thread(target=lambda: forgot.append(pushes_.forget(push.ForgetEngine(
        tenant=TENANT, reader=READER, epoch=EPOCH, engine_key=push.engine_key(SECRET, WORKER, EPOCH, TENANT, READER),
        generation=2))))
    forgetting.start()
    forgetting.join(0.3)
    assert forgetting.is_alive()  # it waits for the push into the old memory
    agent.gate.set()
    running.join(5)
    forgetting.join(5)
    assert forgot == [True] and READER not in agent.peers
    agent.gate = None
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "stale"  # generation 1
    assert pushes_.push(request(arena, generation=2, metadata=metadata(READER))).code == "ok"


def test_pushes_beyond_the_limit_are_refused_at_once(worker, monkeypatch):
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    agent.gate = threading.Event()
    threads = [threading.Thread(target=lambda: pushes_.push(request(arena))) for _ in range(pushes.MAX_PUSHES)]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            if len(agent.writes) == 1 + pushes.MAX_PUSHES:
                break
            threading.Event().wait(0.01)
        with pytest.raises(KVStoreError) as refused:
            pushes_.push(request(arena))
        assert refused.value.kind == "unavailable"
    finally:
        agent.gate.set()
        for t in threads:
            t.join(5)
    assert pushes_.push(request(arena)).code == "ok"
