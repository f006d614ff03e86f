"""The S3 endpoint goes away in the middle of demotions and comes back: the upper tier keeps every
block, failed moves are counted and logged and retried with back-off, and after the endpoint is
back the blocks move down and load back exactly."""

from __future__ import annotations

import httpx
import pytest

from kvstore.core import specs
from tests.fault.conftest import fault_stack
from tests.helpers import wait_until
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS
from tests.stacks import s3_bucket

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
BLOCKS = FULL // BLOCK_TOKENS


@pytest.fixture
def s3_stack(tmp_path, monkeypatch):
    with s3_bucket(tmp_path, monkeypatch, "kv-cache") as moto:
        stack = fault_stack(tmp_path, worker_args=["--s3-bucket", "kv-cache", "--s3-endpoint", moto.url,
                                                  "--s3-prefix", "outage", "--open-metrics"])
        try:
            stack.start_directory()
            stack.start_worker()
            yield stack, moto
        finally:
            stack.close()


def move_failures(url: str) -> float:
    return counted(url, "kvstore_move_failures_total{")


def counted(url: str, prefix: str) -> float:
    """The sum of the series whose line starts with `prefix` on a /metrics page."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_an_s3_outage_loses_nothing_and_demotion_resumes_when_it_is_back(s3_stack):
    stack, moto = s3_stack
    assert stack.engine("save")["stored_tokens"] == FULL
    moto.stop()
    outcome = stack.client.evict_tier(specs.EvictRequest(tier="dram"))
    assert outcome.demoted == 0 and outcome.dropped == 0
    assert stack.client.stats().replicas_by_tier == {"dram": BLOCKS}  # nothing left the upper tier
    assert move_failures(stack.url) >= BLOCKS
    worker = stack.client.worker(stack.worker_name).control_url  # what the worker itself counted
    assert counted(worker, 'kvstore_worker_s3_errors_total{reason="unreachable"}') >= BLOCKS
    assert counted(worker, 'kvstore_worker_moves_total{result="failed",route="dram_s3"}') >= BLOCKS
    assert counted(worker, 'kvstore_worker_moves_total{result="ok"') == 0
    assert "failed" in (stack.tmp / "directory.log").read_text()
    during = stack.engine("load", seed=1)
    assert during["loaded_tokens"] == FULL and during["max_abs_diff"] <= 1e-4, during

    moto.start()  # same port, empty again: the operator recreates the bucket
    moto.client().create_bucket(Bucket="kv-cache")

    def moved() -> bool:  # retried after the back-off
        stack.client.evict_tier(specs.EvictRequest(tier="dram"))
        return stack.client.stats().replicas_by_tier.get("s3", 0) == BLOCKS
    wait_until(moved, 90, "blocks demoted to S3 after the endpoint came back")
    assert "dram" not in stack.client.stats().replicas_by_tier
    after = stack.engine("load", seed=1)  # promoted back from S3
    assert after["loaded_tokens"] == FULL and after["max_abs_diff"] <= 1e-4, after
    worker = stack.client.worker(stack.worker_name).control_url
    assert counted(worker, 'kvstore_worker_moves_total{result="ok",route="dram_s3"}') == BLOCKS
    assert counted(worker, 'kvstore_worker_moved_bytes_total{route="s3_dram"}') > 0
    stack.settled()
