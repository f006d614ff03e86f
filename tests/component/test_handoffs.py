"""Hand-offs, over HTTP against the directory in this process (SQLite and PostgreSQL): a consumer
waits for a producer's commit, or for its blocks, or for its deadline; another tenant's hand-off
is another hand-off; bad input is a 400."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import HandoffCommit, HandoffWait
from tests.calls import chain, complete, prepare
from tests.helpers import wait_until
from tests.stacks import NS, directory_stack, make_settings


def wait(stack, handoff_id: str, hashes=(), timeout_s: float = 5.0, client=None):
    body = HandoffWait(namespace_id=stack.namespace_id, handoff_id=handoff_id, hashes=list(hashes), timeout_s=timeout_s)
    return (client or stack.client).wait_handoff(body)


def commit(stack, handoff_id: str, num_tokens: int = 12, client=None, **fields):
    body = HandoffCommit(namespace_id=stack.namespace_id, handoff_id=handoff_id, num_tokens=num_tokens, **fields)
    return (client or stack.client).commit_handoff(body)


def test_a_consumer_that_waits_first_is_woken_by_the_commit(stack):
    hashes = chain(3)
    seen = {}
    consumer = threading.Thread(target=lambda: seen.setdefault("state", wait(stack, "req-1", hashes)))
    consumer.start()
    waiting = stack.service.handoffs.waiting
    wait_until(lambda: waiting() == 1, 10, "the consumer waits before the producer has saved anything")
    complete(stack, prepare(stack, hashes[:2]))  # a prompt saved in part: not every block is there
    time.sleep(0.5)
    assert consumer.is_alive() and waiting() == 1
    assert commit(stack, "req-1", 8, finished_at=time.time()).state == "committed"
    consumer.join(5)
    state = seen["state"]
    assert (state.state, state.num_tokens) == ("committed", 8) and 0.5 < state.waited_s < 5.0
    again = wait(stack, "req-1")  # a late consumer: at once, from memory
    assert again.state == "committed" and again.waited_s < 0.5


def test_a_wait_ends_when_every_block_is_stored_or_at_its_timeout(stack):
    hashes = chain(2)
    pending = wait(stack, "never", hashes, timeout_s=0.6)
    assert pending.state == "pending" and pending.num_tokens is None and 0.55 < pending.waited_s < 2.0
    complete(stack, prepare(stack, hashes))  # the producer saved but its commit was lost
    present = wait(stack, "never", hashes, timeout_s=5)
    assert present.state == "present" and present.waited_s < 1.0
    assert wait(stack, "never", [], timeout_s=0.3).state == "pending"  # naming no block proves nothing


def test_a_failed_or_repeated_commit_is_what_waiters_hear(stack):
    assert commit(stack, "p-2", 0, failed=True).state == "failed"
    assert wait(stack, "p-2").state == "failed"
    commit(stack, "p-2", 24)  # the router reused the id: the newer commit replaces the older
    assert (wait(stack, "p-2").state, wait(stack, "p-2").num_tokens) == ("committed", 24)


def test_waits_beyond_the_replicas_limit_are_refused_and_the_consumer_asks_again(stack, monkeypatch):
    from kvstore.directory import handoffs

    monkeypatch.setattr(handoffs, "MAX_WAITERS", 1)
    first = threading.Thread(target=lambda: wait(stack, "busy", timeout_s=2.5))
    first.start()
    wait_until(lambda: stack.service.handoffs.waiting() == 1, 10, "the first consumer waits")
    with pytest.raises(KVStoreError) as refused:
        wait(stack, "busy", timeout_s=1)
    assert refused.value.kind == "throttled"
    first.join(10)
    assert wait(stack, "busy", timeout_s=0.1).state == "pending"  # the slot is free again
    assert stack.service.handoffs.waiting() == 0


def test_a_commit_outlives_the_directory_and_expires(database_url):
    """The row is durable: a directory that restarts (or a new leader) still knows the hand-off."""
    settings = make_settings(database_url)
    with directory_stack(settings) as s:
        commit(s, "durable", 16)
    with directory_stack(settings) as s:
        assert wait(s, "durable", timeout_s=0.2).state == "committed"
        from kvstore.directory.handoffs import KEEP_S

        s.service.writer.run(lambda tx: s.service.handoffs.expire(tx, time.time() + KEEP_S + 1))
    with directory_stack(settings) as s:
        assert wait(s, "durable", timeout_s=0.2).state == "pending"


def test_bad_ids_bounds_and_another_tenants_namespace_are_refused(secure):
    token = secure.token("engine", tenants=("acme",))
    acme, other = secure.as_(token), secure.as_(secure.token("engine", tenants=("other",)))
    ns = secure.client.register_namespace(NS.__class__(**{**NS.to_dict(), "tenant": "acme"}))
    body = {"namespace_id": ns, "handoff_id": "h1", "num_tokens": 4}
    assert acme.commit_handoff(HandoffCommit(**body)).state == "committed"
    for client, kind in ((other, "not_found"), (secure.as_(None), "unauthorized")):
        # another tenant's hand-off: as for a namespace that does not exist
        with pytest.raises(KVStoreError) as refused:
            client.wait_handoff(HandoffWait(namespace_id=ns, handoff_id="h1", timeout_s=0))
        assert refused.value.kind == kind
        with pytest.raises(KVStoreError) as refused:
            client.commit_handoff(HandoffCommit(**body))
        assert refused.value.kind == kind
    headers = {"authorization": f"Bearer {token}"}
    post = lambda path, json: secure.http.post(path, json=json, headers=headers)  # noqa: E731
    for bad in ({**body, "handoff_id": "a/b"}, {**body, "handoff_id": "x" * 129}, {**body, "handoff_id": ""},
                {**body, "num_tokens": -1}, {**body, "extra": 1}, {**body, "finished_at": -5}):
        answer = post("/v1/handoffs", bad)
        assert (answer.status_code, answer.json()["error"]) == (400, "invalid"), bad
    wait_body = {"namespace_id": ns, "handoff_id": "h1"}
    for bad in ({**wait_body, "timeout_s": 11}, {**wait_body, "timeout_s": -1}, {**wait_body, "hashes": ["XYZ"]},
                {**wait_body, "hashes": ["ab"] * 32_769}, {"handoff_id": "h1"}):
        answer = post("/v1/handoffs/wait", bad)
        assert (answer.status_code, answer.json()["error"]) == (400, "invalid"), list(bad)

