"""`kvstore workers drain` / `undrain` against real processes: a drained worker takes no new
blocks and holds nothing in memory; a drain waits for readers and can be reversed until it ends."""

from __future__ import annotations

import subprocess

import pytest

from tests.fault.conftest import fault_stack, wait_for
from tests.helpers import kvstore_cmd, wait_until
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
BLOCKS = FULL // BLOCK_TOKENS


@pytest.fixture
def nvme_stack(tmp_path):
    stack = fault_stack(tmp_path, worker_args=["--nvme-bytes", "32MiB", "--nvme-dir", str(tmp_path / "nvme")])
    stack.start_directory()
    stack.start_worker()
    yield stack
    stack.close()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(kvstore_cmd(*args), capture_output=True, text=True, timeout=120)


def test_a_drained_worker_moves_its_memory_down_and_takes_no_new_blocks(nvme_stack):
    stack = nvme_stack
    assert stack.engine("save")["stored_tokens"] == FULL
    done = cli("workers", "drain", "w0", "--wait", "30", "--url", stack.url)
    assert done.returncode == 0 and "w0: drained" in done.stdout, done.stdout + done.stderr
    assert stack.client.stats().replicas_by_tier == {"nvme": BLOCKS}  # nothing left in its DRAM
    assert stack.engine("save", seed=2)["stored_tokens"] == 0  # no placement on a drained worker
    refused = cli("workers", "undrain", "w0", "--url", stack.url)
    assert refused.returncode == 1 and "only a drain that has not finished" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    stack.settled()


def test_a_drain_waits_for_readers_and_can_be_reversed_before_it_ends(nvme_stack):
    stack = nvme_stack
    assert stack.engine("save")["stored_tokens"] == FULL
    reader = stack.engine("load", "--pause-at-complete", "1", wait=False)
    wait_for(reader.markers / "paused", reader)  # every block pinned by a reader
    assert cli("workers", "drain", "w0", "--url", stack.url).returncode == 0
    wait_until(lambda: stack.client.worker("w0").state == "draining", 10, "draining")
    assert stack.client.stats().replicas_by_tier.get("dram") == BLOCKS  # pinned blocks stay put
    undone = cli("workers", "undrain", "w0", "--url", stack.url)
    assert undone.returncode == 0 and "w0: active" in undone.stdout
    (reader.markers / "resume").touch()
    assert reader.wait(timeout=120) == 0
    loaded = stack.result("load")
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    assert stack.engine("save", seed=2)["stored_tokens"] == FULL  # placements again
    stack.settled()
