"""Workers killed mid-save, mid-load and mid-demotion: nothing becomes visible with partial bytes,
lookups stop returning the dead worker's memory replicas within the heartbeat timeout, and the
restarted worker rejoins under a new epoch."""

from __future__ import annotations

import subprocess
import time

from tests.fault.conftest import TTL_S, wait_for
from tests.helpers import kvstore_cmd, wait_until
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS


def dead(stack) -> bool:
    return stack.client.worker("w0").state == "dead"


def test_a_worker_killed_mid_save_commits_nothing_and_rejoins_under_a_new_epoch(stack):
    proc = stack.engine("save", "--pause-at-complete", "1", wait=False)
    wait_for(proc.markers / "paused", proc)  # the bytes are written, the completion not yet sent
    stack.kill(stack.worker)
    wait_until(lambda: dead(stack), TTL_S + 5, "worker declared dead")
    assert stack.start_worker() == 2
    (proc.markers / "resume").touch()
    assert proc.wait(timeout=120) == 0
    assert stack.result("save")["stored_tokens"] == 0  # the completion was refused: its pages died
    assert stack.engine("load")["loaded_tokens"] == 0
    stack.settled()
    assert stack.engine("save", seed=1)["stored_tokens"] == FULL  # the new epoch takes saves
    loaded = stack.engine("load", seed=1)
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    stack.settled()


def test_a_worker_killed_mid_load_turns_the_load_into_a_miss(stack):
    assert stack.engine("save")["stored_tokens"] == FULL
    proc = stack.engine("load", "--pause-at-complete", "1", wait=False)
    wait_for(proc.markers / "paused", proc)
    stack.kill(stack.worker)
    t0 = time.monotonic()
    wait_until(lambda: stack.client.stats().replicas_by_tier.get("dram", 0) == 0, TTL_S + 5,
               "the dead worker's DRAM replicas leave lookups")
    assert time.monotonic() - t0 <= TTL_S + 5
    stack.start_worker()
    (proc.markers / "resume").touch()
    assert proc.wait(timeout=120) == 0
    assert stack.result("load")["loaded_tokens"] == 0  # complete_load refused: the bytes are not vouched for
    stack.settled()


def test_a_worker_killed_mid_demotion_leaves_only_verified_blocks(tmp_path, stack):
    """Four prompts (260 blocks) go down to NVMe in rounds. The worker is killed once a round is on
    NVMe and the next one is in flight: the finished rounds survive the restart, the round in flight
    does not, and nothing that loads is wrong."""
    stack.close()  # this test wants an NVMe tier: start again with one
    stack.worker_args = ["--nvme-bytes", "64MiB", "--nvme-dir", str(tmp_path / "nvme")]
    stack.start_directory()
    stack.start_worker()
    seeds = range(1, 5)
    for seed, proc in [(seed, stack.engine("save", seed=seed, wait=False)) for seed in seeds]:  # at once
        assert proc.wait(timeout=300) == 0 and stack.result("save", seed)["stored_tokens"] == FULL
    client = stack.client
    evict = subprocess.Popen(kvstore_cmd("evict", "--tier", "dram", "--all", "--url", stack.url),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:  # polled tightly: a round of moves lasts tens of milliseconds here
        stats = client.stats()
        if stats.replicas_by_tier.get("nvme", 0) > 0 and stats.inflight_moves > 0:
            break
        assert time.monotonic() < deadline and evict.poll() is None, "no round was seen in flight"
        time.sleep(0.002)
    on_nvme = stats.replicas_by_tier["nvme"]
    stack.kill(stack.worker)
    said = evict.communicate(timeout=120)[0]
    wait_until(lambda: dead(stack), TTL_S + 5, "worker declared dead")
    stack.start_worker()
    stack.settled()
    survived, total = client.stats().replicas_by_tier, len(seeds) * FULL // BLOCK_TOKENS
    assert "dram" not in survived and on_nvme <= survived.get("nvme", 0), survived  # every finished round is there
    # the round in flight was lost with the worker, unless (a stalled test) the kill came after the last round
    assert survived.get("nvme", 0) < total or f"{total} blocks moved one tier down" in said, (survived, said)
    loads = [(seed, stack.engine("load", seed=seed, wait=False)) for seed in seeds]
    for seed, proc in loads:  # whatever is left loads exactly or is a miss, never wrong bytes
        assert proc.wait(timeout=300) == 0
        result = stack.result("load", seed)
        assert result["loaded_tokens"] == 0 or result["max_abs_diff"] <= 1e-4, result
    # saving a prompt again fills in what was lost around the surviving NVMe blocks; all of it loads
    assert stack.engine("save", seed=1)["stored_tokens"] == FULL
    loaded = stack.engine("load", seed=1)
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    stack.settled()


def test_a_connector_follows_a_restarted_worker_into_its_new_epoch(stack):
    import numpy as np

    from kvstore.connector import KVStoreClient
    from tests.fault.prompts import NS, load, prompt, save

    client = KVStoreClient(stack.url, NS, staging_bytes=4 * NS.block_nbytes)
    try:
        assert save(client, *prompt(1)) == 4
        stack.kill(stack.worker)
        wait_until(lambda: dead(stack), TTL_S + 5, "worker declared dead")
        assert load(client, prompt(1)[0])[0] == 0  # its DRAM died with it
        assert stack.start_worker() == 2
        hashes, blocks = prompt(2)
        assert save(client, hashes, blocks) == 4  # the old agent metadata was swapped for the new one
        n, out = load(client, hashes)
        assert n == 4 and all(np.array_equal(a, b) for a, b in zip(out, blocks))
    finally:
        client.close()
    stack.settled()
