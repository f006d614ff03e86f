"""The vLLM connector's hand-off roles against an in-process directory stand-in (same two calls):
which side a request is on, a consumer's wait ending (or cancelled), a bad id, a producer's commit
once its saves are in."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kvstore.connector.vllm.handoff import DEFAULT_TIMEOUT_S, HandoffRoles
from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import HandoffState


class Directory:
    """commit_handoff / wait_handoff as the directory answers them, from memory."""

    def __init__(self) -> None:
        self.committed: dict[str, object] = {}
        self.changed = threading.Condition()
        self.waits = 0

    def commit_handoff(self, body):
        with self.changed:
            self.committed[body.handoff_id] = body
            self.changed.notify_all()
        return HandoffState(handoff_id=body.handoff_id, state="committed", num_tokens=body.num_tokens)

    def wait_handoff(self, body):
        self.waits += 1
        with self.changed:
            self.changed.wait_for(lambda: body.handoff_id in self.committed, body.timeout_s)
            known = self.committed.get(body.handoff_id)
        if known is None:
            return HandoffState(handoff_id=body.handoff_id, state="pending", waited_s=body.timeout_s)
        return HandoffState(handoff_id=body.handoff_id, state="failed" if known.failed else "committed",
                            num_tokens=known.num_tokens)


def request(req_id="r1", params=None, prompt=20, computed=20):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, prompt_token_ids=list(range(prompt)),
                           num_computed_tokens=computed, block_hashes=[], mm_features=None)


def roles(role: str, directory=None, **extra) -> HandoffRoles:
    return HandoffRoles(role, directory or Directory(), 16, "sha256", extra)


def until(fn, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = fn()
        if result is not None:
            return result
        time.sleep(0.01)
    raise TimeoutError


def test_each_role_takes_its_side_of_a_request():
    consumer, producer, both = roles("kv_consumer"), roles("kv_producer"), roles("kv_both")
    plain, handoff = request(params=None), request(params={"handoff_id": "h1"})
    assert (consumer.consumed(handoff), consumer.produced(handoff)) == ("h1", None)
    assert (producer.consumed(handoff), producer.produced(handoff)) == (None, "h1")
    assert producer.produced(plain) == "r1"  # a producer without an id hands off under the request id
    assert (both.consumed(handoff), both.produced(handoff)) == (None, None)  # a cache request
    assert both.consumed(request(params={"handoff_id": "h1", "do_remote_prefill": True})) == "h1"
    assert both.produced(request(params={"handoff_id": "h1", "do_remote_decode": True})) == "h1"
    assert (producer.loads, producer.saves, consumer.loads, consumer.saves) == (False, True, True, False)
    assert (producer.saves_decode, consumer.saves_decode, both.saves_decode) == (False, False, True)
    with pytest.raises(KVStoreError, match="kv_role"):
        roles("kv_sideways")
    for r in (consumer, producer, both):
        r.close()


def test_a_consumer_is_asked_again_until_the_commit_then_knows_it_at_once():
    directory = Directory()
    consumer = roles("kv_consumer", directory)
    r = request(params={"handoff_id": "h2"})
    assert consumer.wait(r, "ns", ["ab"]) is None  # started in the background
    assert consumer.wait(r, "ns", ["ab"]) is None
    directory.commit_handoff(SimpleNamespace(handoff_id="h2", num_tokens=20, failed=False))
    result = until(lambda: consumer.wait(r, "ns", ["ab"]))
    assert result.outcome == "committed" and result.num_tokens == 20
    waits = directory.waits
    again = consumer.wait(r, "ns", ["ab"])  # asked again after a preemption: no new wait
    assert again.outcome == "committed" and directory.waits == waits
    assert consumer.take_stats()["handoff_wait_s"] and not consumer.take_stats()["handoff_wait_s"]
    consumer.close()


def test_deadlines_bad_ids_foreign_namespaces_and_cancelled_waits():
    consumer = roles("kv_consumer", handoff_timeout_s=0.3)
    late = request("late", {"handoff_id": "never"})
    assert consumer.wait(late, "ns", []) is None
    assert until(lambda: consumer.wait(late, "ns", [])).outcome == "timeout"
    assert consumer.take_stats()["handoff_timeout_s"]
    bad = request("bad", {"handoff_id": "a/b"})  # the directory would refuse it: ends at once
    consumer.wait(bad, "ns", [])
    assert until(lambda: consumer.wait(bad, "ns", [])).outcome == "error"
    foreign = request("foreign", {"handoff_id": "h", "namespace_id": "other"})
    assert consumer.wait(foreign, "ns", []).outcome == "error"  # no wait at all
    gone = request("gone", {"handoff_id": "h3", "handoff_timeout_s": 30})
    assert consumer.wait(gone, "ns", []) is None
    consumer.forget("gone")  # the request was aborted
    assert consumer.wait(gone, "ns", []) is None  # asked again, it would start a new wait
    assert roles("kv_consumer", handoff_timeout_s="soon").timeout_s == DEFAULT_TIMEOUT_S
    assert roles("kv_consumer", handoff_timeout_s=0).timeout_s == DEFAULT_TIMEOUT_S
    consumer.close()


def test_a_producer_commits_after_its_saves_and_fails_an_unfinished_prompt():
    directory = Directory()
    producer = roles("kv_producer", directory)
    params = producer.finished(request("p1"), "p1", "ns", 20, saving=True)
    assert params == {"handoff_id": "p1", "namespace_id": "ns", "num_tokens": 20, "do_remote_prefill": True,
                      "do_remote_decode": False}
    producer.flush()
    assert "p1" not in directory.committed  # its saves are still in flight
    producer.sent({"p1", "someone-else"})
    producer.flush()
    assert directory.committed["p1"].num_tokens == 20 and not directory.committed["p1"].failed
    producer.finished(request("p2", computed=5), "p2", "ns", 16, saving=False)  # aborted mid-prefill
    producer.flush()
    assert directory.committed["p2"].failed and directory.committed["p2"].num_tokens == 0
    assert producer.produced(request(params={"handoff_id": "x" * 129})) is None  # logged, not committed
    assert len(producer.take_stats()["handoff_commit_s"]) == 2
    producer.close()


def test_a_requests_hints_are_checked_once_and_reach_its_saves():
    import torch

    from kvstore.connector.vllm.worker import BlockPlan, PagedKVWorker

    roles_ = roles("kv_both")
    good = request("g", {"hints": {"session_id": "chat-1", "retain": "turn", "priority": 1}})
    assert roles_.hints(good) == {"session_id": "chat-1", "retain": "turn", "priority": 1}
    assert roles_.hints(request("b", {"hints": {"retain": "forever"}})) is None  # dropped with a warning
    assert roles_.hints(request("n", None)) is None
    roles_.forget("g")
    assert "g" not in roles_._hints
    roles_.close()

    sent = []

    class Capturing:
        def prepare_store(self, body):
            sent.append(body)
            raise KVStoreError("unavailable", "not here")

    worker = PagedKVWorker(Capturing(), ["l0"], (1, 16, 8), torch.float32, timeout_s=1.0)
    worker.caches = {"l0": torch.zeros(4, 1, 16, 8)}
    worker._reserve("ns", BlockPlan("g", ["ab"], [0], hints={"retain": "turn"}))
    worker.close()
    assert sent[0].hints is not None and sent[0].hints.retain == "turn"


def test_the_clients_hints_are_checked_before_anything_is_sent():
    from kvstore.connector.calls import request_hints as _request_hints
    from kvstore.core import specs

    assert _request_hints({"session_id": "s", "retain": "none"}) == specs.RequestHints(session_id="s", retain="none")
    assert _request_hints(None) is None
    for bad in ({"retain": "forever"}, {"priority": 101}, {"other": 1}):
        with pytest.raises(KVStoreError) as refused:
            _request_hints(bad)
        assert refused.value.kind == "invalid"
