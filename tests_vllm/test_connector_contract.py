"""KVStoreConnector against the real vLLM 0.33 classes on the CPU (make setup-vllm): the factory
builds both roles from a VllmConfig, and engine processes made of vLLM's own Scheduler and the
connector's worker half (tests_vllm/engine.py) move prompts' paged KV through a real kvstore
stack (directory + worker processes, NIXL UCX)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)

from kvstore.client import DirectoryClient
from kvstore.connector.vllm import KVStoreConnector
from kvstore.core import vllm_hashes
from kvstore.core.errors import KVStoreError
from tests_vllm.engine import BLOCK, HEAD, HEADS, LAYER_NAMES, LAYERS, PROMPT_TOKENS, configs, prompt

FULL_BLOCKS = PROMPT_TOKENS // BLOCK  # 10; a load leaves the last token to compute: all 10 fit
CHUNK = ("--max-batched-tokens", "64")  # A prefills its 165 tokens in three steps: 64, 64, 37


def test_the_factory_builds_both_roles_from_a_vllm_config():
    vllm_config, kv_cache_config = configs("http://127.0.0.1:1")
    assert vllm_config.kv_transfer_config.kv_connector_module_path == "kvstore.connector.vllm"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        connector = KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)
        assert isinstance(connector, KVStoreConnector) and connector.role == role
        assert connector.requires_kv_delivery is False  # a cache: vLLM keeps in-flight output at preemption
        connector.shutdown()
    # its per-layer hooks must run between the layers: vLLM then keeps CUDA graphs piecewise
    assert KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config).requires_piecewise_for_cudagraph({})


def test_a_config_without_directory_url_or_with_bad_hosts_is_refused_with_one_clear_message():
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connector.vllm",
                                kv_role="kv_both")
    vllm_config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK))
    _, kv_cache_config = configs("http://127.0.0.1:1")
    with pytest.raises(KVStoreError, match="needs directory_url"):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connector.vllm",
                                kv_role="kv_both", kv_connector_extra_config={
                                    "directory_url": "http://127.0.0.1:1", "hosts": "10.0.0.7"})
    vllm_config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK))
    with pytest.raises(KVStoreError, match="hosts must be a list"):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def full(**kw):
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, **kw)


@pytest.mark.parametrize("groups, message", [
    ([KVCacheGroupSpec(LAYER_NAMES[:2], full()),
      KVCacheGroupSpec(LAYER_NAMES[2:], SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                                         dtype=torch.float32, sliding_window=64))],
     "one KV cache group; this model has 2"),
    ([KVCacheGroupSpec(LAYER_NAMES, MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD,
                                                     dtype=torch.float32))], "MLAAttentionSpec"),
    ([KVCacheGroupSpec(LAYER_NAMES, full(head_size_v=2 * HEAD))], "different head sizes"),
], ids=["hybrid", "mla", "head_size_v"])
def test_kv_caches_the_store_cannot_describe_are_refused_at_start_up(groups, message):
    vllm_config, _ = configs("http://127.0.0.1:1")
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(KVStoreError, match=message):
            KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)


def test_a_kv_cache_layout_that_splits_pages_is_refused_at_start_up():
    vllm_config, kv_cache_config = configs("http://127.0.0.1:1", kv_layout="LHBNC")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(KVStoreError, match="splits a block's page"):
            KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)


def test_each_tensor_parallel_rank_stores_its_shard_under_its_own_namespace(stack):
    from vllm.config import ParallelConfig
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.utils.hashing import get_hash_fn_by_name

    init_none_hash(get_hash_fn_by_name("sha256"))
    ids = {}
    for rank in (0, 1):
        vllm_config, kv_cache_config = configs(stack.url)
        vllm_config.parallel_config = ParallelConfig(tensor_parallel_size=2)
        vllm_config.kv_transfer_config.kv_connector_extra_config["tp_rank"] = rank  # vLLM's group is not set up here
        scheduler = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
        ids[rank] = (meta.namespace_id, worker._rank_namespace_id(meta))
        expected = dataclasses.replace(scheduler.namespace(), tp_rank=rank, tp_size=2).namespace_id
        worker.shutdown()
        scheduler.shutdown()
    assert ids[0][0] == ids[1][0] == ids[0][1]  # the scheduler looks up rank 0's namespace
    assert ids[1][1] != ids[0][1] and ids[1][1] == expected  # rank 1 saves and loads its own heads elsewhere


@pytest.mark.parametrize("block, dtype", [(2 * BLOCK, torch.float32), (BLOCK, torch.float16)],
                         ids=["block_size", "dtype"])
def test_pages_that_do_not_match_the_namespace_are_refused_at_registration(block, dtype):
    vllm_config, kv_cache_config = configs("http://127.0.0.1:1")
    worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    backing = torch.zeros(LAYERS, 8, HEADS, block, 2 * HEAD, dtype=dtype)  # not what the namespace says
    with pytest.raises(KVStoreError, match="do not match the namespace"):
        worker.register_kv_caches({name: backing[i] for i, name in enumerate(LAYER_NAMES)})
    worker.shutdown()


def test_a_prompt_prefilled_in_chunks_is_saved_and_engine_b_loads_it_into_other_block_ids(stack):
    a = stack.engine(*CHUNK, "--hold-blocks", "3")
    saved = a["requests"]["req-0"]
    assert saved["matched"] == [0, False] and saved["computed_prompt_tokens"] == PROMPT_TOKENS
    assert saved["kv_exact"] and saved["store_hits_at_free"] == FULL_BLOCKS  # all 10 committed before the free
    b = stack.engine("--hold-blocks", "30")
    loaded = b["requests"]["req-0"]
    assert loaded["matched"] == [FULL_BLOCKS * BLOCK, False] and loaded["sources"] == {"host": FULL_BLOCKS * BLOCK}
    assert loaded["computed_prompt_tokens"] == PROMPT_TOKENS - FULL_BLOCKS * BLOCK  # B computed only 5 tokens
    assert loaded["kv_exact"] and b["load_errors"] == []  # B's pages hold A's KV, in other block ids
    assert loaded["load_block_ids"] == loaded["first_block_ids"][:FULL_BLOCKS]
    assert set(loaded["load_block_ids"]).isdisjoint(saved["block_ids"])
    assert loaded["keys"] == saved["keys"] and b["namespace_id"] == a["namespace_id"]
    counts = b["histogram_counts"]  # the layer-wise timings of the vLLM path
    assert (counts["load_post"], counts["layer_xfer"], counts["layer_visible"]) == (1, LAYERS, LAYERS)
    assert a["histogram_counts"]["save"] == 3  # one per prefill chunk
    # the same timings through vLLM's own path: stats -> scheduler -> front end's log and /metrics
    assert b["vllm_metric_counts"] == {"load_post": 1, "layer_xfer": LAYERS, "layer_visible": LAYERS, "save": 0}
    assert a["vllm_metric_counts"]["save"] == 3 and "save_count=3" in a["vllm_log"][0]
    assert "layer_xfer_count=4" in b["vllm_log"][0]
    # the worker is on this host: every layer was copied with its arena, none went over NIXL
    assert a["posts"] == {"local": 3 * LAYERS, "nixl": 0} and b["posts"] == {"local": LAYERS, "nixl": 0}


@pytest.mark.parametrize("save, load", [("off", "auto"), ("auto", "off")])
def test_pages_copied_with_the_arena_and_moved_over_nixl_are_the_same_bytes(stack, save, load):
    a = stack.engine("--same-host", save)
    b = stack.engine("--same-host", load, "--hold-blocks", "30")
    loaded = b["requests"]["req-0"]
    assert loaded["matched"] == [FULL_BLOCKS * BLOCK, False] and loaded["kv_exact"] and b["load_errors"] == []
    assert [e["posts"]["local"] > 0 for e in (a, b)] == [save == "auto", load == "auto"]
    assert [e["posts"]["nixl"] > 0 for e in (a, b)] == [save == "off", load == "off"]


@pytest.mark.parametrize("load_path", ["auto", "off"])
def test_nhd_pages_round_trip_in_their_own_namespace_and_never_meet_hnd_ones(stack, load_path):
    """vLLM's NHD layout (LBNHC: a page's tokens outermost): saved and loaded with the arena, and
    loaded over NIXL (its checksum then gathered from the pages, in their memory order). An HND
    engine with the same model finds none of the NHD engine's blocks, nor it any of the HND one's."""
    a = stack.engine("--kv-layout", "LBNHC")
    assert a["posts"]["local"] > 0 and a["requests"]["req-0"]["kv_exact"]
    b = stack.engine("--kv-layout", "LBNHC", "--same-host", load_path, "--hold-blocks", "30")
    loaded = b["requests"]["req-0"]
    assert loaded["matched"] == [FULL_BLOCKS * BLOCK, False] and loaded["kv_exact"] and b["load_errors"] == []
    assert b["posts"] == ({"local": LAYERS, "nixl": 0} if load_path == "auto" else {"local": 0, "nixl": LAYERS})
    if load_path == "auto":  # the namespaces apart, both ways
        hnd = stack.engine("--kv-layout", "LBHNC")  # prompt 0, which the NHD engines hold: a miss here
        assert hnd["requests"]["req-0"]["matched"] == [0, False] and hnd["namespace_id"] != a["namespace_id"]
        assert hnd["requests"]["req-0"]["kv_exact"]  # and saved, under HND
        again = stack.engine("--kv-layout", "LBHNC", "--hold-blocks", "30")
        assert again["requests"]["req-0"]["matched"] == [FULL_BLOCKS * BLOCK, False]  # HND's own copy hits
        hnd_1 = stack.engine("--kv-layout", "LBHNC", "--prompt-seed-offset", "1")  # saves prompt 1 under HND
        nhd_1 = stack.engine("--kv-layout", "LBNHC", "--prompt-seed-offset", "1")
        assert hnd_1["requests"]["req-0"]["kv_exact"] and nhd_1["requests"]["req-0"]["matched"] == [0, False]


def test_blocks_are_freed_only_after_their_saves_are_committed(stack):
    a = stack.engine("--slow-save-s", "1.0")  # every save stays in flight for a second
    saved = a["requests"]["req-0"]
    assert saved["sent_step"] == saved["freed_step"] > saved["finished_step"]  # vLLM held the blocks meanwhile
    assert saved["store_hits_at_free"] == FULL_BLOCKS and saved["kv_exact"]
    b = stack.engine()  # nothing to save (all loaded): request_finished lets vLLM free at once
    loaded = b["requests"]["req-0"]
    assert loaded["freed_step"] == loaded["finished_step"] and "sent_step" not in loaded


def test_a_preempted_request_keeps_its_blocks_until_its_saves_are_flushed(stack):
    # 15 usable blocks, two 100-token prompts decoding 40 tokens each: vLLM must preempt one
    a = stack.engine("--prompts", "2", "--prompt-tokens", "100", "--num-blocks", "16", "--max-tokens", "40",
                     "--slow-save-s", "3.0")
    assert a["preempted"] and a["unfreed"] == []
    for req_id in a["preempted"]:
        report = a["requests"][req_id]
        assert report["saves_in_flight_at_preemption"] >= 1  # the save was still running ...
        assert report["store_hits_after_flush"] == 100 // BLOCK  # ... and was committed before the blocks' reuse
    assert all(r["kv_exact"] and r["store_hits_at_free"] == 100 // BLOCK for r in a["requests"].values())


def test_a_failed_load_is_recomputed_saved_again_and_never_saved_over(stack):
    stack.engine()
    longer = ("--prompt-tokens", str(PROMPT_TOKENS + 2 * BLOCK))  # the same prompt and two more blocks
    # the blocks go after the lookup; each step's saves end before the next step (the recompute) writes
    b = stack.engine(*longer, "--evict-before-load", "--wait-saves")
    loaded = b["requests"]["req-0"]
    assert loaded["matched"] == [FULL_BLOCKS * BLOCK, False]
    assert b["load_errors"] == sorted(loaded["load_block_ids"]) and len(b["load_errors"]) == FULL_BLOCKS
    assert loaded["kv_exact"] and loaded["computed_prompt_tokens"] > PROMPT_TOKENS  # vLLM recomputed them
    assert loaded["store_hits_at_free"] == FULL_BLOCKS + 2  # the recomputed blocks were saved again ...
    # ... and blocks 10 and 11 hold what the recompute wrote, not what the step over the missing KV wrote
    c = stack.engine(*longer)
    again = c["requests"]["req-0"]
    assert again["matched"] == [(FULL_BLOCKS + 2) * BLOCK, False] and again["kv_exact"] and c["load_errors"] == []


def test_generated_blocks_are_saved_so_the_next_turn_hits_the_answer_too(stack):
    a = stack.engine("--max-tokens", "40")  # 165 prompt + 40 generated tokens; the last one's KV is never computed
    first = a["requests"]["req-0"]
    assert first["kv_exact"] and first["store_hits_at_free"] == FULL_BLOCKS
    assert DirectoryClient(stack.url).lookup(a["namespace_id"], first["all_keys"]).num_hit_blocks == 12  # 204 // 16
    b = stack.engine("--followup", "40", "--hold-blocks", "20")  # the next turn: the prompt and the answer
    turn = b["requests"]["req-0"]
    assert turn["matched"] == [12 * BLOCK, False] and turn["kv_exact"] and b["load_errors"] == []
    assert turn["computed_prompt_tokens"] == PROMPT_TOKENS + 40 - 12 * BLOCK


def test_an_asynchronous_load_is_reported_by_get_transfer_results(stack):
    stack.engine(*CHUNK)
    b = stack.engine("--load-async", "--hold-blocks", "30")
    loaded = b["requests"]["req-0"]
    assert loaded["matched"] == [FULL_BLOCKS * BLOCK, True]
    assert (b["finished_recving"], b["failed_recving"], b["load_errors"]) == (["req-0"], [], [])
    assert loaded["kv_exact"] and loaded["computed_prompt_tokens"] == PROMPT_TOKENS - FULL_BLOCKS * BLOCK


def test_a_failed_asynchronous_load_is_in_failed_recving_and_its_blocks_in_load_errors(stack):
    stack.engine()
    b = stack.engine("--load-async", "--evict-before-load")
    loaded = b["requests"]["req-0"]
    assert b["finished_recving"] == ["req-0"] and b["failed_recving"] == ["req-0"]
    assert b["load_errors"] == sorted(loaded["load_block_ids"]) and len(b["load_errors"]) == FULL_BLOCKS
    assert loaded["kv_exact"] and loaded["computed_prompt_tokens"] == PROMPT_TOKENS  # recomputed by vLLM


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "xxhash_cbor"])
def test_stored_keys_are_vllms_own_block_hashes(stack, algo):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    env = {**os.environ, "PYTHONHASHSEED": "1234"}  # xxhash seeds NONE_HASH from it (else at random)
    a = stack.engine("--hash", algo, env=env)
    os.environ["PYTHONHASHSEED"] = "1234"
    try:
        hash_fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(hash_fn)
        tokens = prompt()
        parent, expected = None, []
        for j in range(FULL_BLOCKS):  # vLLM's chain, computed here with vLLM's own function
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[j * BLOCK:(j + 1) * BLOCK])
            expected.append(parent.hex())
    finally:
        del os.environ["PYTHONHASHSEED"]
    assert a["requests"]["req-0"]["keys"][:FULL_BLOCKS] == expected
    directory = DirectoryClient(stack.url)
    assert directory.lookup(a["namespace_id"], expected).num_hit_blocks == FULL_BLOCKS
    # operators' token lookups hash like vLLM without it, from the namespace's scheme and the seed
    scheme = next(n.hash_scheme for n in directory.namespaces() if n.namespace_id == a["namespace_id"])
    assert vllm_hashes.block_hashes(scheme, BLOCK, tokens, seed="1234") == expected
    assert directory.lookup_tokens(a["namespace_id"], tokens, hash_seed="1234").hit_tokens == FULL_BLOCKS * BLOCK
