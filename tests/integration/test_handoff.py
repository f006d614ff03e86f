"""A prefill/decode hand-off with the reference engine in two processes: the decode engine starts
waiting before the prefill engine has begun, loads the prompt's KV through the store once the
hand-off commits, computes only the last prompt token, and its first logits and next tokens are a
colocated prefill's. A hand-off that never comes, and a stale one, end in a recompute."""

from __future__ import annotations

import json

import pytest

from kvstore.client import DirectoryClient
from tests.integration.engine import PROMPT_TOKENS
from tests.stacks import ProcessStack, engines


@pytest.fixture
def stack(tmp_path):
    s = ProcessStack(tmp_path)
    s.start_directory()
    s.start_worker()
    yield s
    s.close()


def start(stack, tmp_path, mode: str, name: str, *args: str):
    return engines().spawn("tests.integration.engine", [mode, "--url", stack.url, "--out",
                                                        str(tmp_path / f"{name}.json"), *args], tmp_path / f"{name}.log")


def result(proc, tmp_path, name: str) -> dict:
    assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_decode_waits_for_the_handoff_and_decodes_as_a_colocated_engine(stack, tmp_path):
    waiting = str(tmp_path / "decode.waiting")
    decode = start(stack, tmp_path, "decode", "decode", "--handoff", "pd-1", "--timeout-s", "120", "--waiting", waiting)
    prefill = start(stack, tmp_path, "prefill", "prefill", "--handoff", "pd-1", "--after", waiting, "--delay-s", "1")
    p, d = result(prefill, tmp_path, "prefill"), result(decode, tmp_path, "decode")
    assert p["stored_tokens"] == PROMPT_TOKENS  # 65 full blocks
    # it waited, then loaded; "present" when the blocks' commit reached it before the hand-off's own
    assert d["outcome"] in ("committed", "present") and d["waiting_at"] < p["finished_at"], (d, p)
    assert d["loaded_tokens"] == PROMPT_TOKENS - 1 and d["computed_tokens"] == 1
    assert d["first_logits_diff"] <= 1e-4, d
    assert d["generated"] == d["reference"] and d["generated"][0] == p["first_token"]

    # a hand-off that never comes: the deadline passes, the prompt is computed whole
    never = result(start(stack, tmp_path, "decode", "never", "--handoff", "never", "--timeout-s", "1",
                         "--prompt-seed", "2"), tmp_path, "never")
    assert never["outcome"] == "timeout" and 1.0 <= never["waited_s"] < 5.0
    assert never["loaded_tokens"] == 0 and never["first_logits_diff"] <= 1e-4
    assert never["generated"] == never["reference"]
    # a stale id, committed for another prompt: at once, and nothing of this prompt is there
    stale = result(start(stack, tmp_path, "decode", "stale", "--handoff", "pd-1", "--prompt-seed", "2"),
                   tmp_path, "stale")
    assert stale["outcome"] == "committed" and stale["waited_s"] < 1.0 and stale["loaded_tokens"] == 0
    assert stale["generated"] == stale["reference"]

    stats = DirectoryClient(stack.url).stats()
    assert (stats.reservations, stats.leases_active, stats.pins) == (0, 0, 0)
