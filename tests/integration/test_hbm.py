"""GPU paths: an HBM tier (CUDA arena registered as VRAM) read by engines over UCX and demoted to
DRAM, or with GDS straight to NVMe and back. Marked `gpu`: skipped without CUDA; these have not
run on a GPU yet."""

from __future__ import annotations

import json
import subprocess
from contextlib import contextmanager

import pytest

from tests.helpers import kvstore_cmd
from tests.stacks import ProcessStack, run_engine
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS

pytestmark = pytest.mark.gpu
FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS


@contextmanager
def gpu_stack(tmp_path, *worker_args: str):
    """A directory and a worker with a 64 MiB HBM tier (and `worker_args`); yields (url, client)."""
    with ProcessStack(tmp_path, worker_name="gpu0", worker_start_s=120.0, worker_memory=[
            "--page-bytes", "16KiB", "--hbm-bytes", "64MiB", "--dram-bytes", "64MiB", *worker_args]) as stack:
        yield stack.url, stack.client


def test_hbm_blocks_are_read_over_ucx_and_demoted_to_dram(tmp_path):
    with gpu_stack(tmp_path) as (url, client):
        assert run_engine(url, "save", tmp_path, 1)["stored_tokens"] == FULL
        tiers = {t.kind: t for t in client.tiers()}
        assert tiers["hbm"].num_blocks == FULL // BLOCK_TOKENS  # new blocks land in HBM first

        loaded = run_engine(url, "load", tmp_path, 1)  # the CPU engine reads VRAM over UCX
        assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded

        moved = subprocess.run(kvstore_cmd("evict", "--tier", "hbm", "--all", "--url", url), capture_output=True,
                               text=True, timeout=120)
        assert moved.returncode == 0 and "dropped" in moved.stdout, moved.stderr
        tiers = {t["kind"]: t for t in json.loads(subprocess.run(
            kvstore_cmd("tiers", "--url", url, "--output", "json"), capture_output=True, text=True).stdout)}
        assert (tiers["hbm"]["num_blocks"], tiers["dram"]["num_blocks"]) == (0, FULL // BLOCK_TOKENS)
        loaded = run_engine(url, "load", tmp_path, 1)
        assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded


def test_hbm_and_nvme_move_through_gds(tmp_path):
    """With HBM and NVMe and the GDS_MT backend (--gds on), HBM victims go straight to NVMe and an
    NVMe-only prefix is promoted back into HBM, disk to GPU; loads stay exact."""
    with gpu_stack(tmp_path, "--nvme-bytes", "64MiB", "--nvme-dir", str(tmp_path / "nvme"), "--gds", "on") \
            as (url, client):
        assert "GDS_MT" in client.worker("gpu0").backends
        assert run_engine(url, "save", tmp_path, 1)["stored_tokens"] == FULL
        moved = subprocess.run(kvstore_cmd("evict", "--tier", "hbm", "--all", "--url", url), capture_output=True,
                               text=True, timeout=120)
        assert moved.returncode == 0, moved.stderr
        kinds = {t.kind: t.num_blocks for t in client.tiers()}
        assert (kinds["hbm"], kinds["dram"], kinds["nvme"]) == (0, 0, FULL // BLOCK_TOKENS)  # HBM -> NVMe directly
        loaded = run_engine(url, "load", tmp_path, 1)  # promoted NVMe -> HBM through GDS, read over UCX
        assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
        assert {t.kind: t.num_blocks for t in client.tiers()}["hbm"] == FULL // BLOCK_TOKENS
