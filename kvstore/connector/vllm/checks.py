"""What the vLLM connector checks of vLLM's configuration at start-up: the KV cache it can describe,
and the tensor-parallel rank it runs as."""

from __future__ import annotations

from typing import Any

import torch

from kvstore.core.errors import KVStoreError
from kvstore.core.keys import VLLM_LAYOUTS

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def page_layout(kv_cache_layout: str | None) -> str:
    """The store's name for the byte order of vLLM's pages under its resolved KV cache layout
    (`cache_config.kv_cache_layout`, a `KVCacheLayout` name; None before vLLM resolved one: its
    CPU backend's, head-major). A page must be one run of bytes; layouts that interleave layers
    or blocks within a page are refused."""
    order = {"LBHNC": "HND", "BLHNC": "HND", "HND": "HND", "LBNHC": "NHD", "BLNHC": "NHD", "NHD": "NHD",
             None: "HND"}.get(kv_cache_layout)
    if order is None:
        raise KVStoreError("invalid", f"vLLM's KV cache layout {kv_cache_layout} splits a block's page of one "
                           "layer into several runs; KVStoreConnector handles LBHNC, LBNHC, BLHNC and BLNHC")
    return VLLM_LAYOUTS[0] if order == "HND" else VLLM_LAYOUTS[1]


def checked_pages(kv_caches: dict[str, torch.Tensor], layer_names: list[str], page_shape: tuple[int, int, int],
                  dtype: torch.dtype, layout: str = VLLM_LAYOUTS[0]) -> dict[int, tuple[int, torch.device]]:
    """The allocations behind vLLM's pages, {address: (bytes, device)}; pages the namespace does not
    describe are refused. Each layer is vLLM's logical view [blocks, heads, block_size, head +
    head_v], a block's page one run of bytes: heads outermost (`layout` HND) or tokens (NHD)."""
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise KVStoreError("invalid", f"register_kv_caches lacks layers {missing[:3]}")
    storages = {}
    for name in layer_names:
        t = kv_caches[name]
        page = t[0] if t.dim() == 4 else None
        if page is None or not (page if layout == VLLM_LAYOUTS[0] else page.transpose(0, 1)).is_contiguous():
            raise KVStoreError("invalid", f"layer {name}: expected [blocks, heads, block_size, head+head_v] "
                               f"pages, each one run of bytes in {layout} order, got shape {tuple(t.shape)} "
                               f"strides {t.stride()}")
        if tuple(t.shape[1:]) != page_shape or t.dtype != dtype:
            raise KVStoreError("invalid", f"layer {name}: pages {tuple(t.shape[1:])} of {t.dtype} do not match "
                               f"the namespace: {page_shape} (kv heads, block size, 2 x head size) of {dtype}")
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(), t.device)
    return storages


def tp_rank(extra: dict) -> int:
    """This worker's tensor-parallel rank (vLLM's process group), or `tp_rank` from the extra
    config where vLLM's distributed state is not set up (tests)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, AttributeError, ImportError):
        return int(extra.get("tp_rank", 0))


def check_kv_cache_config(kv_cache_config) -> Any:
    """The one full-attention KV spec the connector handles, or a one-line refusal at start-up."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise KVStoreError("invalid", f"KVStoreConnector handles one KV cache group; this model has {len(groups)} "
                           "(a hybrid model): start vLLM with --disable-hybrid-kv-cache-manager or without the connector")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:  # its subclasses too: MLA, sink, ...
        raise KVStoreError("invalid", f"KVStoreConnector handles full attention with separate K and V pages; "
                           f"{type(spec).__name__} (MLA, sliding window, ...) is not supported yet")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise KVStoreError("invalid", f"K and V of different head sizes ({spec.head_size}, {spec.head_size_v}) "
                           "are not supported yet")
    if spec.dtype not in DTYPES:
        raise KVStoreError("invalid", f"KV dtype {spec.dtype} is not one the store names ({', '.join(DTYPES.values())})")
    return spec
