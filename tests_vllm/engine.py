"""One engine process driving KVStoreConnector through vLLM 0.33's call order, with vLLM's own
config, factory, Request (block hashes by vLLM), KVCacheBlocks and SchedulerOutput, and a
paged KV buffer in vLLM's per-layer [blocks, heads, block_size, 2 x head] layout.

    python -m tests_vllm.engine save|load --url URL --out R.json [--hash sha256] [--first-block 3]
                                          [--evict-before-load] [--load-async]

`save` fills the prompt's pages with known values and lets the connector save them; `load`
starts from an empty buffer, asks the scheduler half what is cached, loads it into other block
ids and reports whether the pages equal what `save` wrote.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BLOCK, HEADS, HEAD, LAYERS, NUM_BLOCKS = 16, 2, 8, 4, 64
PROMPT_TOKENS = 16 * 10 + 5  # 10 full blocks and a partial one
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def configs(url: str, hash_algo: str, load_async: bool = False):
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connector.vllm",
                                kv_role="kv_both",
                                kv_connector_extra_config={"directory_url": url, "model_id": "contract-model",
                                                           "load_async": load_async})
    vllm_config = VllmConfig(kv_transfer_config=transfer,
                             cache_config=CacheConfig(block_size=BLOCK, prefix_caching_hash_algo=hash_algo))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])
    return vllm_config, kv_cache_config


def prompt() -> list[int]:
    return torch.randint(0, 30_000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


def expected_page(layer: int, block: int) -> torch.Tensor:
    """What `save` writes into the page of the prompt's block `block` in layer `layer`."""
    g = torch.Generator().manual_seed(1000 * layer + block)
    return torch.randn(HEADS, BLOCK, 2 * HEAD, generator=g)


def paged_kv() -> dict[str, torch.Tensor]:
    backing = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)  # one allocation, as vLLM does
    return {name: backing[i] for i, name in enumerate(LAYER_NAMES)}


def step(scheduler, worker, request: Request, block_ids: list[int], computed: int, kv) -> set[int]:
    """One engine step for a new request scheduled whole: metadata, loads, per-layer saves."""
    output = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(request, (block_ids,))],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={request.request_id: len(request.prompt_token_ids) - computed},
        total_num_scheduled_tokens=len(request.prompt_token_ids) - computed,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[])
    worker.bind_connector_metadata(scheduler.build_connector_meta(output))
    worker.start_load_kv(None)
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, kv[name], None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


def async_load(scheduler, worker, request: Request, timeout_s: float = 60) -> tuple[set[int], set[str], set[str]]:
    """vLLM's asynchronous mode: the step that starts the load does not schedule the request; the
    engine polls get_transfer_results between steps until the request's load is reported."""
    import time

    worker.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput.make_empty()))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    finished, failed, deadline = set(), set(), time.monotonic() + timeout_s
    while request.request_id not in finished and time.monotonic() < deadline:
        results = worker.get_transfer_results(set())
        finished |= results.finished_recving
        failed |= results.failed_recving
        time.sleep(0.01)
    return worker.get_block_ids_with_load_errors(), finished, failed


def run(args) -> dict:
    hash_fn = get_hash_fn_by_name(args.hash)
    init_none_hash(hash_fn)
    vllm_config, kv_cache_config = configs(args.url, args.hash, args.load_async)
    scheduler = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv = paged_kv()
    worker.register_kv_caches(kv)
    tokens = prompt()
    request = Request(f"req-{args.mode}", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK, hash_fn))
    scheduler.on_new_request(request)
    full = PROMPT_TOKENS // BLOCK
    block_ids = list(range(args.first_block, args.first_block + full + 1))
    matched, load_async = scheduler.get_num_new_matched_tokens(request, 0)
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],))
    scheduler.update_state_after_alloc(request, blocks, matched)
    sources = {str(k.value): v for k, v in scheduler.get_external_cache_hit_sources(request, matched).items()}
    if args.evict_before_load:
        from kvstore.client import DirectoryClient

        DirectoryClient(args.url).evict(scheduler.namespace().namespace_id)
    if args.mode == "save":
        for layer, name in enumerate(LAYER_NAMES):  # the "forward": the prompt's KV lands in its pages
            for j in range(full):
                kv[name][block_ids[j]] = expected_page(layer, j)
    finished = failed = set()
    if load_async and matched:
        errors, finished, failed = async_load(scheduler, worker, request)
    else:
        errors = step(scheduler, worker, request, block_ids, matched, kv)
    loaded = matched // BLOCK
    equal = [all(torch.equal(kv[name][block_ids[j]], expected_page(layer, j)) for layer, name in enumerate(LAYER_NAMES))
             for j in range(loaded)]
    result = {"matched_tokens": matched, "load_async": load_async, "load_errors": sorted(errors), "sources": sources,
              "loaded_blocks_equal": equal, "block_ids": block_ids, "finished_recving": sorted(finished),
              "failed_recving": sorted(failed),
              "keys": [h.hex() for h in request.block_hashes],
              "namespace_id": scheduler.namespace().namespace_id}
    worker.shutdown()
    scheduler.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hash", default="sha256")
    parser.add_argument("--first-block", type=int, default=0)
    parser.add_argument("--evict-before-load", action="store_true")
    parser.add_argument("--load-async", action="store_true")
    args = parser.parse_args()
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip interpreter teardown (NIXL.md pitfall 3)


if __name__ == "__main__":
    main()
