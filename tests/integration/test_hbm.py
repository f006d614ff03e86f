"""GPU paths: an HBM tier (CUDA arena registered as VRAM) read by engines over UCX and demoted to
DRAM, or with GDS straight to NVMe and back; the vLLM connector's paged KV in GPU memory saved to
and loaded from a worker's DRAM and HBM tiers. Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager

import pytest

import torch

from kvstore.client import DirectoryClient
from kvstore.connector import KVStoreClient, Namespace
from kvstore.connector.hf import layerwise_cache
from kvstore.connector.vllm.worker import PagedKVWorker
from kvstore.core.keys import block_hashes
from tests.helpers import kvstore_cmd
from tests.paged import load_pages, save_pages
from tests.stacks import ProcessStack, run_engine
from tests.integration.engine import (BLOCK_TOKENS, CONTINUATION_TOKENS, PROMPT_TOKENS, build_model, namespace_of,
                                      tokens)

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
        assert layerwise_diff(url) <= 1e-4  # and so do layer-wise loads

        moved = subprocess.run(kvstore_cmd("evict", "--tier", "hbm", "--all", "--url", url), capture_output=True,
                               text=True, timeout=120)
        assert moved.returncode == 0 and "dropped" in moved.stdout, moved.stderr
        tiers = {t["kind"]: t for t in json.loads(subprocess.run(
            kvstore_cmd("tiers", "--url", url, "--output", "json"), capture_output=True, text=True).stdout)}
        assert (tiers["hbm"]["num_blocks"], tiers["dram"]["num_blocks"]) == (0, FULL // BLOCK_TOKENS)
        loaded = run_engine(url, "load", tmp_path, 1)
        assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded


@torch.no_grad()
def layerwise_diff(url: str) -> float:
    """A layer-wise load of prompt 1 (every block), each layer handed to the model as it arrives: the
    largest difference of its logits from a full prefill's."""
    model = build_model()
    full = tokens(PROMPT_TOKENS, seed=1) + tokens(CONTINUATION_TOKENS, seed=10_001)
    with KVStoreClient(url, namespace_of(model), staging_bytes=8 << 20) as client:
        load = client.start_load_layers(full)
        assert load.num_tokens == FULL
        with layerwise_cache(model, load) as cache:
            logits = model(torch.tensor([full[FULL:]]), past_key_values=cache, use_cache=True).logits[0, -1]
        assert load.finish() == FULL // BLOCK_TOKENS, "a layer-wise load of the HBM tier failed"
    return float((logits - model(torch.tensor([full])).logits[0, -1]).abs().max())


def cufile_config(tmp_path, monkeypatch, **properties) -> None:
    """cuFile's configuration for the worker: `properties` over its defaults."""
    path = tmp_path / "cufile.json"
    path.write_text(json.dumps({"properties": properties}))
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(path))


def test_hbm_and_nvme_move_through_gds(tmp_path, monkeypatch):
    """With HBM and NVMe and the GDS_MT backend (--gds on), HBM victims go straight to NVMe and an
    NVMe-only prefix is promoted back into HBM, disk to GPU; loads stay exact. cuFile may use its
    compatibility mode (a host without the nvidia-fs driver, such as a VM): the same calls."""
    cufile_config(tmp_path, monkeypatch, allow_compat_mode=True)
    try:
        with gpu_stack(tmp_path, "--nvme-bytes", "64MiB", "--nvme-dir", str(tmp_path / "nvme"), "--gds", "on") \
                as (url, client):
            moves_through_gds(url, client, tmp_path)
    except RuntimeError as exc:  # the worker's own start-up check refused GDS here: nothing to test
        if "GDS cannot read the NVMe tier's files" not in str(exc):
            raise
        pytest.skip("cuFile cannot open files on this host, even in compatibility mode: the GDS path cannot run")


def moves_through_gds(url: str, client, tmp_path) -> None:
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


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia-fs"), reason="about hosts where cuFile needs nvidia-fs")
def test_gds_that_cannot_reach_the_nvme_files_is_refused_or_left_to_dram(tmp_path, monkeypatch):
    """Where cuFile cannot open the NVMe tier's files (no nvidia-fs, compatibility mode off), a
    worker asked for GDS (--gds on) refuses to start with one line; with --gds auto it starts without
    GDS, and HBM victims go to DRAM (then NVMe) instead of failing to move."""
    cufile_config(tmp_path, monkeypatch, allow_compat_mode=False)
    memory = ["--page-bytes", "16KiB", "--hbm-bytes", "64MiB", "--dram-bytes", "64MiB", "--nvme-bytes", "64MiB"]
    refused = subprocess.run(kvstore_cmd("worker", "serve", "--directory-url", "http://127.0.0.1:9", *memory,
                                         "--nvme-dir", str(tmp_path / "nvme-on"), "--gds", "on"),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--gds on:" in refused.stderr, refused.stderr  # no backend, or no files
    assert "Traceback" not in refused.stderr, refused.stderr
    with gpu_stack(tmp_path, "--nvme-bytes", "64MiB", "--nvme-dir", str(tmp_path / "nvme"), "--gds", "auto") \
            as (url, client):
        assert "GDS_MT" not in client.worker("gpu0").backends
        assert run_engine(url, "save", tmp_path, 1)["stored_tokens"] == FULL
        moved = subprocess.run(kvstore_cmd("evict", "--tier", "hbm", "--all", "--url", url), capture_output=True,
                               text=True, timeout=120)
        assert moved.returncode == 0, moved.stderr
        kinds = {t.kind: t.num_blocks for t in client.tiers()}
        assert (kinds["hbm"], kinds["dram"]) == (0, FULL // BLOCK_TOKENS), kinds
        loaded = run_engine(url, "load", tmp_path, 1)
        assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded


@pytest.mark.parametrize("tier,same_host", [("dram", "auto"), ("dram", "off"), ("hbm", "auto")])
def test_paged_kv_in_gpu_memory_is_saved_and_loaded_exactly(tmp_path, monkeypatch, tier, same_host):
    """vLLM's path on a GPU: each layer's page of every block moves between the engine's GPU memory
    and the worker: copied by the GPU with the worker's mapped DRAM arena (same host), or over NIXL
    UCX (sharing off; an HBM tier); the saver waits for a CUDA event per layer. What arrives is the
    saved bytes; on the same-host path a byte changed in the arena fails that block and the rest."""
    monkeypatch.setenv("KVSTORE_SAME_HOST", same_host)
    memory = ["--page-bytes", "16KiB", "--dram-bytes", "64MiB"] + (["--hbm-bytes", "64MiB"] if tier == "hbm" else [])
    ns = Namespace(model_id=f"paged-gpu-{tier}", num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16",
                   block_tokens=16, layout="layer_head_token_kvdim")
    with ProcessStack(tmp_path, worker_name="gpu0", worker_start_s=120.0, worker_memory=memory) as stack:
        directory = DirectoryClient(stack.url)
        namespace_id = directory.register_namespace(ns)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(ns.num_layers)]
        generator = torch.Generator(device="cuda").manual_seed(7)
        pages = torch.randn((ns.num_layers, 24, 2, 16, 64), device="cuda", generator=generator).to(torch.bfloat16)
        worker = PagedKVWorker(directory, names, (2, 16, 64), torch.bfloat16)
        copied = tier == "dram" and same_host == "auto"
        try:
            worker.register({name: pages[i] for i, name in enumerate(names)})
            hashes = [h.hex() for h in block_hashes(ns, list(range(6 * 16)))]
            save_pages(worker, namespace_id, "save", hashes, [0, 1, 2, 3, 4, 5])
            assert directory.lookup(namespace_id, hashes).num_hit_blocks == 6
            assert {t.kind: t.num_blocks for t in directory.tiers()}[tier] == 6

            assert load_pages(worker, namespace_id, "intact", hashes, [8, 9, 10, 11, 12, 13]) == set()
            assert torch.equal(pages[:, 8:14].view(torch.int16), pages[:, 0:6].view(torch.int16))
            assert (worker.posts["local"] > 0, worker.posts["nixl"] > 0) == (copied, not copied), worker.posts
            if copied:
                location = directory.lookup(namespace_id, hashes, locations=True).blocks[3].location
                arena = worker.arenas._arenas["gpu0"]
                arena.array[location.runs[0][0] - arena.base_addr + 100] ^= 0xFF
                assert load_pages(worker, namespace_id, "bad", hashes, [16, 17, 18, 19, 20, 21]) == {19, 20, 21}
                assert torch.equal(pages[:, 16:19].view(torch.int16), pages[:, 0:3].view(torch.int16))
                assert directory.lookup(namespace_id, hashes).num_hit_blocks == 3  # block 3's replica invalidated
        finally:
            worker.close()
