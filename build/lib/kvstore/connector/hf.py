"""HuggingFace transformers `DynamicCache` <-> the connector's per-layer (K, V) form.

A DynamicCache layer holds keys/values as [batch, num_kv_heads, seq, head_dim];
the connector uses [num_kv_heads, seq, head_dim] for a single sequence.
"""

from __future__ import annotations

from contextlib import contextmanager

from kvstore.connector.layout import LayerKV
from kvstore.core.errors import KVStoreError


def from_dynamic_cache(cache, num_tokens: int | None = None) -> LayerKV:
    """Per-layer (K, V) of batch row 0, optionally only the first `num_tokens` tokens."""
    kv = []
    for layer in cache.layers:
        if layer.keys is None or layer.keys.shape[0] != 1:
            raise KVStoreError("invalid", "expected a filled DynamicCache with batch size 1")
        keys, values = layer.keys[0], layer.values[0]
        if num_tokens is not None:
            keys, values = keys[:, :num_tokens], values[:, :num_tokens]
        kv.append((keys.contiguous(), values.contiguous()))
    return kv


def to_dynamic_cache(kv: LayerKV, config=None):
    """A DynamicCache (batch size 1) holding `kv`; pass the model config to get its layer types."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in kv], config=config)


@contextmanager
def layerwise_cache(model, load):
    """A DynamicCache that receives layer l of a `LayerwiseLoad` just before decoder layer l runs
    (forward pre-hooks), so the model computes layer l while later layers are still arriving.
    Layer 0 is filled first: the model reads the cache length before any layer runs."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layers = model.model.layers

    def fill(index: int) -> None:
        kv = load.wait_layer(index)
        if kv is None:
            raise KVStoreError("unavailable", f"layer {index} of the cached prefix could not be read; recompute")
        cache.update(kv[0][None], kv[1][None], index)

    def hook(index: int):
        return lambda module, args, kwargs: fill(index)

    fill(0)
    handles = [layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in range(1, len(layers))]
    try:
        yield cache
    finally:
        for handle in handles:
            handle.remove()
