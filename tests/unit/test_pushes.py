"""The worker's side of pushed loads with an in-process agent: who may register which metadata,
how many pushes run at once, and what a push that does not finish leaves behind."""

from __future__ import annotations

import base64
import struct
import threading
import time

import pytest

from kvstore.core import push
from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.transfer import JOIN_BYTES
from kvstore.worker import pushes
from kvstore.worker.pushes import Pushes, agent_name
from tests.helpers import wait_until

SECRET, WORKER, EPOCH, TENANT, OWNER, READER = "s" * 43, "w0", 3, "t", "tok-1", "kvstore-client-e1"


def blob(name: str) -> bytes:
    return b"nixlSerDes|Agent" + struct.pack("<Q", len(name)) + name.encode() + b"|Conns\x08rest"


class FakeTransfer:
    def __init__(self, state: str, gate: threading.Event | None) -> None:
        self.state, self.gate, self.error = state, gate, None if state == "done" else "timed out"
        self.abandoned = state == "abandoned"

    def settled(self) -> bool:
        return True

    def wait(self, _timeout_s: float) -> str:
        if self.gate is not None:
            self.gate.wait(10)
        return self.state


class FakeAgent:
    def __init__(self) -> None:
        self.peers: set[str] = {"w1-0123abcd"}  # a peer worker of the moves
        self.writes: list[tuple] = []
        self.joins: list[int] = []
        self.state, self.gate = "done", None

    def has_peer(self, name: str) -> bool:
        return name in self.peers

    def add_peer(self, metadata: bytes) -> str:
        name = agent_name(metadata)
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def submit(self, op, local, remote, peer, mem_type="DRAM", remote_mem_type="DRAM", join_up_to=0):
        self.writes.append((op, local.tolist(), remote.tolist(), peer))
        self.joins.append(join_up_to)
        return FakeTransfer(self.state, self.gate)

    def forget_key(self, reader: str = READER, owner: str = OWNER, generation: int = 2) -> push.ForgetEngine:
        return push.ForgetEngine(tenant=TENANT, owner=owner, reader=reader, epoch=EPOCH, generation=generation,
                                 engine_key=push.engine_key(SECRET, WORKER, EPOCH, TENANT, owner, reader))


@pytest.fixture
def worker():
    arena = HostBuffer(1 << 20)
    agent = FakeAgent()
    return Pushes(agent, arena, lambda: (WORKER, EPOCH, SECRET)), agent, arena


def request(arena: HostBuffer, reader: str = READER, generation: int = 1, metadata: str | None = None,
            owner: str = OWNER, **changes) -> push.PushRequest:
    runs = [(arena.addr, 4096), (arena.addr + 8192, 4096)]
    fields = dict(tenant=TENANT, owner=owner, reader=reader, epoch=EPOCH, token="tok", expires_at=4e9, runs=runs,
                  grant=push.lease_grant(SECRET, WORKER, EPOCH, TENANT, owner, reader, "tok", 4e9, runs),
                  engine_key=push.engine_key(SECRET, WORKER, EPOCH, TENANT, owner, reader), items=[(1, 1 << 40)],
                  engine=push.EngineMemory(generation=generation, metadata=metadata))
    return push.PushRequest(**{**fields, **changes})


def running_push(pushes_: Pushes, agent: FakeAgent, arena: HostBuffer, writes: int) -> threading.Thread:
    """A push of generation 1 held inside its transfer until `agent.gate` is set."""
    agent.gate = threading.Event()
    thread = threading.Thread(target=lambda: pushes_.push(request(arena)))
    thread.start()
    wait_until(lambda: len(agent.writes) == writes, 2, "the push running")
    return thread


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
    assert agent.joins == [JOIN_BYTES]  # rows that follow each other go joined (`transfer.joined`)
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
                                    {"tenant": "other"}, {"owner": "tok-2"}, {"runs": [(1, 4096), (2, 4096)]}])
def test_a_push_the_directory_did_not_sign_is_forbidden(worker, change):
    pushes_, agent, arena = worker
    with pytest.raises(KVStoreError) as refused:
        pushes_.push(request(arena, metadata=metadata(READER)).model_copy(update=change))
    assert refused.value.kind == "forbidden" and not agent.writes


def test_runs_outside_the_arena_are_refused_even_when_signed(worker):
    pushes_, agent, arena = worker
    runs = [(arena.addr + arena.nbytes, 4096)]
    body = request(arena, metadata=metadata(READER), runs=runs, items=[(0, 1 << 40)],
                   grant=push.lease_grant(SECRET, WORKER, EPOCH, TENANT, OWNER, READER, "tok", 4e9, runs))
    with pytest.raises(KVStoreError) as refused:
        pushes_.push(body)
    assert refused.value.kind == "invalid" and not agent.writes


def test_a_push_that_does_not_finish_cuts_the_engine_off_until_it_registers_again(worker):
    pushes_, agent, arena = worker
    agent.state = "failed"  # refused at once: nothing may still write, the engine stays registered
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "failed"
    assert READER in agent.peers
    agent.state = "abandoned"  # timed out while posted
    assert pushes_.push(request(arena)).code == "failed"
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
    forgetting = threading.Thread(target=lambda: forgot.append(pushes_.forget(agent.forget_key())))
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


def test_another_engine_cannot_push_into_or_forget_an_engine_s_memory(worker):
    """Engine B, with a credential of its own, names engine A's reader: the directory signs B's key
    over B's credential, so the worker keeps B apart from A's registration."""
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    assert pushes_.forget(agent.forget_key(owner="tok-b", generation=1 << 62))  # B's floor, not A's
    assert pushes_.push(request(arena)).code == "ok"  # A is still pushed to
    assert pushes_.push(request(arena, owner="tok-b", metadata=metadata(READER))).code == "stale"  # B's own floor
    running = running_push(pushes_, agent, arena, 3)
    try:
        with pytest.raises(KVStoreError) as refused:  # engine C names A's reader while A's push runs
            pushes_.push(request(arena, owner="tok-c", metadata=metadata(READER)))
        assert refused.value.kind == "conflict"
    finally:
        agent.gate.set()
        running.join(5)
    agent.gate = None
    assert [w[2] for w in agent.writes] == [[[1 << 40, 4096]]] * 3  # only A's own pushes were written


def test_numbers_past_what_the_wire_takes_are_a_validation_error_not_a_crash(worker):
    _, _, arena = worker
    for change in ({"runs": [(-1, 4096)]}, {"runs": [(1 << 64, 4096)]}, {"items": [(0, 1 << 64)]},
                   {"items": [(0, 0)]}, {"engine": {"generation": 1 << 70}}, {"wait_s": 1e9}):
        with pytest.raises(ValueError):
            push.PushRequest.model_validate({**request(arena).model_dump(), **change})


def test_a_registration_waiting_on_running_pushes_never_outlives_a_forget_sent_meanwhile(worker):
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    answers: dict[str, object] = {}
    running = running_push(pushes_, agent, arena, 2)
    newer = threading.Thread(target=lambda: answers.setdefault(
        "newer", pushes_.push(request(arena, generation=2, metadata=metadata(READER)))))
    newer.start()  # waits: the push into generation 1's memory runs
    forgetting = threading.Thread(target=lambda: answers.setdefault("forgot", pushes_.forget(
        agent.forget_key(generation=3))))
    forgetting.start()
    threading.Event().wait(0.2)
    agent.gate.set()
    for t in (running, newer, forgetting):
        t.join(5)
    assert answers["forgot"] is True
    assert answers["newer"].code == "stale" and READER not in agent.peers and len(agent.writes) == 2


def test_a_push_waits_for_a_registration_no_longer_than_its_own_time(worker):
    """The engine reads instead once a push's time is up: a push that waited for the engine's
    earlier pushes that long never starts (it would write into buffers the engine reuses)."""
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    running = running_push(pushes_, agent, arena, 2)
    try:
        started = time.monotonic()
        with pytest.raises(KVStoreError) as refused:
            pushes_.push(request(arena, generation=2, metadata=metadata(READER), wait_s=0.3))
        assert refused.value.kind == "unavailable" and time.monotonic() - started < 2
    finally:
        agent.gate.set()
        running.join(5)
    assert len(agent.writes) == 2  # the waiting push wrote nothing


def test_one_engine_s_slow_metadata_load_holds_up_no_other_engine(worker):
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    loading, loaded = threading.Event(), agent.add_peer

    def slow_add_peer(blob):
        loading.wait(10)
        return loaded(blob)
    agent.add_peer = slow_add_peer
    other = "kvstore-client-e2"
    registering = threading.Thread(target=lambda: pushes_.push(request(arena, reader=other, metadata=metadata(other))))
    registering.start()
    try:
        threading.Event().wait(0.1)
        started = time.monotonic()
        assert pushes_.push(request(arena)).code == "ok"  # engine 1 is pushed to while engine 2's load runs
        assert time.monotonic() - started < 2
        with pytest.raises(KVStoreError) as waited:  # engine 2's next push waits for that load, up to its time
            pushes_.push(request(arena, reader=other, wait_s=0.2))
        assert waited.value.kind == "unavailable"
    finally:
        loading.set()
        registering.join(5)
    assert pushes_.push(request(arena, reader=other)).code == "ok"
    assert [w[3] for w in agent.writes] == [READER, READER, other, other]


def test_one_credential_s_forgets_never_push_out_another_s_floor(worker):
    pushes_, agent, arena = worker
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "ok"
    assert pushes_.forget(agent.forget_key(generation=2))
    for i in range(pushes.MAX_FLOORS * pushes.MAX_CREDENTIALS + 10):  # another credential forgets many engines
        assert pushes_.forget(agent.forget_key(reader=f"kvstore-client-x{i}", owner="tok-b", generation=5))
    assert pushes_.push(request(arena, metadata=metadata(READER))).code == "stale"  # generation 1 < 2, still
