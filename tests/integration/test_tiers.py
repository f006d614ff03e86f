"""DRAM pressure demotes to NVMe (NIXL POSIX); loads promote back; NVMe survives a SIGKILL of the stack."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvstore.client import DirectoryClient
from kvstore.core.keys import block_hashes
from tests.helpers import kvstore_cmd
from tests.stacks import ProcessStack, run_engine
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS, build_model, namespace_of, tokens

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS  # 1040 tokens = 65 blocks of 16 KiB


@pytest.fixture
def stack(tmp_path):
    """A directory and a worker with 2 MiB of DRAM over 16 MiB of NVMe (16 KiB pages)."""
    with ProcessStack(tmp_path, worker_memory=["--page-bytes", "16KiB", "--dram-bytes", "2MiB", "--nvme-bytes",
                                                "16MiB", "--nvme-dir", str(tmp_path / "nvme")]) as s:
        yield s


def by_tier(client: DirectoryClient, seed: int) -> dict:
    ns = namespace_of(build_model())
    hashes = [h.hex() for h in block_hashes(ns, tokens(PROMPT_TOKENS, seed=seed))]
    found = client.lookup(ns.namespace_id, hashes)
    assert Counter(found.tiers()) == found.by_tier and len(found.tiers()) == found.num_hit_blocks
    located = client.lookup(ns.namespace_id, hashes, locations=True)  # blocks may move in between
    assert located.tiers() == [b.location.tier for b in located.blocks]
    return found.by_tier


def test_demotion_promotion_and_survival_of_a_kill(tmp_path, stack):
    url, client = stack.url, stack.client
    for seed in (1, 2, 3):  # three prompts of ~1 MiB into a 2 MiB DRAM tier
        assert run_engine(url, "save", tmp_path, seed)["stored_tokens"] == FULL
    tiers = {t.kind: t for t in client.tiers()}
    assert tiers["nvme"].num_blocks > 0 and tiers["dram"].used_bytes <= tiers["dram"].capacity_bytes
    assert by_tier(client, 1).get("nvme", 0) > 0  # the oldest prompt went down

    loaded = run_engine(url, "load", tmp_path, 1)  # promoted back into DRAM to be read
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    stats = client.stats()
    assert (stats.pins, stats.leases_active, stats.reservations) == (0, 0, 0)

    stack.kill_all()
    stack.start_directory()
    assert stack.start_worker() == 2
    client = stack.client  # the second run: DRAM is gone, NVMe is not
    assert "dram" not in by_tier(client, 1)  # DRAM died with the worker; NVMe came back
    assert sum(by_tier(client, 1).values()) == FULL // BLOCK_TOKENS
    loaded = run_engine(url, "load", tmp_path, 1)
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    stats = client.stats()
    assert (stats.pins, stats.leases_active, stats.reservations) == (0, 0, 0)


def test_a_corrupted_nvme_page_shortens_the_load_and_invalidates_the_replica(tmp_path, stack):
    import httpx

    url, client = stack.url, stack.client
    for seed in (1, 2, 3):
        run_engine(url, "save", tmp_path, seed)
    assert by_tier(client, 1).get("nvme", 0) == FULL // BLOCK_TOKENS  # prompt 1 lives on NVMe only
    ns = namespace_of(build_model())
    hashes = [h.hex() for h in block_hashes(ns, tokens(PROMPT_TOKENS, seed=1))]
    hit = client.lookup(ns.namespace_id, hashes, locations=True).blocks[10]
    assert hit.location.tier == "nvme"
    offset = hit.location.runs[0][0]  # the NVMe location is a file offset in slab 0
    with open(tmp_path / "nvme" / "slab-0000.bin", "r+b") as slab:
        slab.seek(offset + 100)
        slab.write(b"\xde\xad\xbe\xef")

    loaded = run_engine(url, "load", tmp_path, 1)
    assert loaded["loaded_tokens"] == 10 * BLOCK_TOKENS and loaded["max_abs_diff"] <= 1e-4, loaded
    assert client.lookup(ns.namespace_id, hashes).num_hit_blocks == 10  # the bad replica is gone
    assert "kvstore_checksum_failures_total 1.0" in httpx.get(url + "/metrics").text


def test_an_unwritable_nvme_dir_is_one_clear_error(tmp_path):
    import subprocess

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the NVMe directory should be")
    result = subprocess.run(kvstore_cmd("worker", "serve", "--directory-url", "http://127.0.0.1:9",
                                        "--nvme-bytes", "1MiB", "--nvme-dir", str(blocker / "nvme")),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot prepare NVMe slab" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="about hosts without CUDA")
def test_an_hbm_tier_without_cuda_is_refused_with_one_line(tmp_path):
    import subprocess

    result = subprocess.run(kvstore_cmd("worker", "serve", "--directory-url", "http://127.0.0.1:9",
                                        "--hbm-bytes", "1GiB"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "an HBM tier needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr
