"""Engines that die or stall mid-call, and leases that run out: what they held is reclaimed within
the TTL, and what the store still serves loads with the logits of a full prefill."""

from __future__ import annotations

from tests.fault.conftest import TTL_S, wait_for
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS  # 65 blocks of 16 tokens
CHUNK = 16  # blocks per reservation when an engine saves in chunks


def test_an_engine_killed_mid_save_leaves_a_whole_block_prefix_or_nothing(stack):
    # chunks 1 and 2 complete, the engine dies before completing chunk 3
    proc = stack.engine("save", "--staging-blocks", str(CHUNK), "--pause-at-complete", "3", wait=False)
    wait_for(proc.markers / "paused", proc)
    assert stack.client.stats().reservations == CHUNK
    stack.kill(proc)
    stack.settled()  # the open reservation is rolled back by the reaper
    loaded = stack.engine("load")
    assert loaded["loaded_tokens"] == 2 * CHUNK * BLOCK_TOKENS
    assert loaded["max_abs_diff"] <= 1e-4, loaded
    stack.settled()


def test_an_engine_killed_mid_load_gives_its_pins_back_and_others_still_load(stack):
    assert stack.engine("save")["stored_tokens"] == FULL
    proc = stack.engine("load", "--pause-at-complete", "1", wait=False)
    wait_for(proc.markers / "paused", proc)
    stats = stack.client.stats()
    assert (stats.leases_active, stats.pins) == (1, FULL // BLOCK_TOKENS)
    stack.kill(proc)
    stack.settled()
    loaded = stack.engine("load", seed=1)
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    stack.settled()


def test_renewal_keeps_slow_transfers_alive_and_without_it_they_are_misses(stack):
    slow = str(2 * TTL_S)  # each transfer outlasts the TTL twice over
    renewed = stack.engine("save", "--slow-s", slow, seed=1, wait=False)  # side by side: other prompts
    unrenewed = stack.engine("save", "--slow-s", slow, "--no-renew", seed=2, wait=False)
    assert renewed.wait(timeout=300) == 0 and unrenewed.wait(timeout=300) == 0
    assert stack.result("save", 1)["stored_tokens"] == FULL  # renewed reservation
    assert stack.result("save", 2)["stored_tokens"] == 0  # expired
    stack.settled()
    kept = stack.engine("load", "--slow-s", slow, seed=1)
    assert kept["loaded_tokens"] == FULL and kept["max_abs_diff"] <= 1e-4, kept
    lost = stack.engine("load", "--slow-s", slow, "--no-renew", seed=1)
    assert lost["loaded_tokens"] == 0  # the lease expired under the read: the bytes cannot be trusted
    again = stack.engine("load", seed=1)
    assert again["loaded_tokens"] == FULL and again["max_abs_diff"] <= 1e-4, again
    assert stack.engine("load", seed=2)["loaded_tokens"] == 0  # the expired save left nothing visible
    stack.settled()
