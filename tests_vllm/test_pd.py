"""Prefill/decode disaggregation through the store, with vLLM 0.33's own Scheduler on both sides
(tests_vllm/engine.py): a kv_producer engine prefills and hands its KV off, a kv_consumer engine
waits for the hand-off, loads every prompt token but the last and computes only that one. Each
engine checks every computed position of every layer against the KV a colocated engine computes
(`kv_exact`). Every failure ends in a recompute, never in wrong KV, and leaves no lease, pin or
reservation behind."""

from __future__ import annotations

import signal
import time

import pytest

from kvstore.client import DirectoryClient
from tests.helpers import wait_until
from tests_vllm.conftest import Stack
from tests_vllm.engine import BLOCK, PROMPT_TOKENS

PRODUCER = ("--role", "kv_producer", "--handoff", "pd", "--max-tokens", "1")
CONSUMER = ("--role", "kv_consumer", "--handoff", "pd", "--handoff-timeout-s", "60")


def consumer(timeout_s: float, handoff: str = "pd") -> tuple[str, ...]:
    return ("--role", "kv_consumer", "--handoff", handoff, "--handoff-timeout-s", str(timeout_s))
TTL_S = 2.0


@pytest.fixture
def short(tmp_path):
    """A stack whose leases, reservations and heartbeats expire after TTL_S."""
    s = Stack(tmp_path, ttl_s=TTL_S)
    s.start()
    yield s
    s.stop()


def idle(stack, within_s: float = 3 * TTL_S + 5) -> None:
    """No lease, pin or reservation is left (expired ones included)."""
    client = DirectoryClient(stack.url)
    wait_until(lambda: (lambda s: (s.reservations, s.leases_active, s.pins) == (0, 0, 0))(client.stats()),
               within_s, "no pins, leases or reservations")


def recomputed(report: dict) -> None:
    assert report["kv_exact"] and report["computed_prompt_tokens"] == PROMPT_TOKENS, report


def test_the_producer_hands_its_prompt_off_and_the_consumer_computes_one_token(stack):
    p = stack.engine(*PRODUCER)
    made = p["requests"]["req-0"]
    assert made["matched"] == [0, False] and made["kv_exact"]  # a producer never loads
    assert made["kv_transfer_params"] == {"handoff_id": "pd-0", "namespace_id": p["namespace_id"],  # for a router
                                          "num_tokens": PROMPT_TOKENS, "do_remote_prefill": True,
                                          "do_remote_decode": False, "remote_prefill_cached_tokens": 0}  # vLLM's
    assert made["sent_step"] > made["finished_step"]  # held until the partial block's save was in
    directory = DirectoryClient(stack.url)
    assert directory.stats().blocks == PROMPT_TOKENS // BLOCK + 1  # ten full blocks and the partial one
    d = stack.engine(*CONSUMER)
    taken = d["requests"]["req-0"]
    assert taken["handoff"]["outcome"] == "committed" and d["namespace_id"] == p["namespace_id"]
    assert taken["matched"] == [PROMPT_TOKENS - 1, False]  # every prompt token but the last
    assert taken["sources"] == {"host": PROMPT_TOKENS - 1}
    assert taken["computed_prompt_tokens"] == 1 and taken["kv_exact"] and d["load_errors"] == []
    assert len(taken["load_block_ids"]) == PROMPT_TOKENS // BLOCK + 1
    assert directory.stats().blocks == PROMPT_TOKENS // BLOCK + 1  # a consumer saves nothing
    assert "handoff_wait_count=1" in d["vllm_log"][0] and "handoff_commit_count=1" in p["vllm_log"][0]
    # kv_both engines take the side vLLM's flags name, here for another prompt
    both = ("--handoff", "both", "--max-tokens", "1", "--prompt-seed-offset", "3")
    p = stack.engine(*both, "--handoff-side", "producer")
    assert p["requests"]["req-0"]["kv_transfer_params"]["handoff_id"] == "both-0"
    taken = stack.engine(*both, "--handoff-side", "consumer")["requests"]["req-0"]
    assert taken["handoff"]["outcome"] == "committed" and taken["computed_prompt_tokens"] == 1 and taken["kv_exact"]
    idle(stack)


def test_a_consumer_that_comes_first_waits_without_holding_up_other_requests(stack):
    # two prompts on the consumer; only the first waits for a hand-off, the second is computed meanwhile
    d = stack.start_engine(*CONSUMER, "--prompts", "2", "--handoff-only", "1", "--max-tokens", "4")
    time.sleep(8)  # the consumer is up and waiting before the producer starts
    p = stack.engine(*PRODUCER)
    d = stack.report(d)
    waited, other = d["requests"]["req-0"], d["requests"]["req-1"]
    assert waited["waiting_since"] < p["requests"]["req-0"]["finished_at"]  # it asked before the prefill ended
    # its blocks may be seen stored (present) a moment before the producer's commit arrives
    assert waited["asked_while_waiting"] >= 2 and waited["handoff"]["outcome"] in ("committed", "present")
    assert waited["computed_prompt_tokens"] == 1 and waited["kv_exact"]  # it loaded: no recompute
    assert other["finished_step"] < waited["finished_step"] and other["kv_exact"]  # not held up
    idle(stack)


def test_a_preempted_consumer_loads_its_hand_off_again(stack):
    # 15 usable blocks, two 100-token prompts decoding 40 tokens each: vLLM must preempt one
    shape = ("--prompts", "2", "--prompt-tokens", "100")
    stack.engine(*PRODUCER, *shape)
    d = stack.engine(*CONSUMER, *shape, "--num-blocks", "16", "--max-tokens", "40")
    assert d["preempted"] and d["unfreed"] == [] and d["load_errors"] == []
    for report in d["requests"].values():
        assert report["handoff"]["outcome"] == "committed" and report["kv_exact"], report
        assert report["matched"] == [99, False]
    idle(stack)


def test_a_producer_killed_mid_save_ends_in_a_recompute(short, tmp_path):
    marker = tmp_path / "finished"
    p = short.start_engine(*PRODUCER, "--slow-save-s", "30", "--finished-marker", str(marker))
    d = short.start_engine(*consumer(4))
    wait_until(marker.exists, 120, "the producer's request finished")
    p.send_signal(signal.SIGKILL)  # its saves were in flight: nothing committed, no hand-off
    p.wait()
    taken = short.report(d)["requests"]["req-0"]
    assert taken["handoff"]["outcome"] == "timeout" and taken["handoff"]["waited_s"] >= 4.0
    recomputed(taken)
    idle(short)  # the dead producer's reservations expired


def test_a_worker_killed_mid_handoff_ends_in_a_recompute(short, tmp_path):
    marker = tmp_path / "finished"
    p = short.start_engine(*PRODUCER, "--slow-save-s", "3", "--finished-marker", str(marker))
    wait_until(marker.exists, 120, "the producer's request finished")
    short.procs[1].send_signal(signal.SIGKILL)  # the store's only worker, while the saves are in flight
    made = short.report(p)["requests"]["req-0"]  # its saves failed; it commits what is there: nothing
    assert made["kv_exact"] and "sent_step" in made
    taken = short.engine(*CONSUMER)["requests"]["req-0"]
    assert taken["handoff"]["outcome"] == "committed"
    recomputed(taken)
    idle(short)


def test_a_handoff_that_never_comes_a_stale_one_and_a_foreign_one_end_in_a_recompute(stack):
    stack.engine(*PRODUCER)  # commits pd-0 for prompt 0
    never = stack.engine(*consumer(2, "never"), "--prompt-seed-offset", "7")["requests"]["req-0"]
    assert never["handoff"]["outcome"] == "timeout" and 2.0 <= never["handoff"]["waited_s"] < 10
    recomputed(never)
    # nobody commits it, but the prompt's blocks are all stored: that ends the wait as well
    present = stack.engine(*consumer(30, "never"))["requests"]["req-0"]
    assert present["handoff"]["outcome"] == "present" and present["computed_prompt_tokens"] == 1
    # a stale id: pd-0, committed for another prompt; at once, and nothing of this prompt is stored
    stale = stack.engine(*CONSUMER, "--prompt-seed-offset", "5")["requests"]["req-0"]
    assert stale["handoff"]["outcome"] == "committed" and stale["handoff"]["waited_s"] < 2.0
    recomputed(stale)
    # another tenant's engine: the producer's params name another namespace: refused at once
    foreign = stack.engine(*CONSUMER, "--tenant", "other", "--handoff-params",
                           '{"namespace_id": "0123456789abcdef"}')["requests"]["req-0"]
    assert foreign["handoff"]["outcome"] == "error" and foreign["handoff"]["waited_s"] < 1.0
    recomputed(foreign)
    idle(stack)
