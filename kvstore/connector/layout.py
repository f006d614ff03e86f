"""Per-layer engine KV <-> the store's block layout [L][K,V][T][H][D]."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from kvstore.core.errors import KVStoreError
from kvstore.core.keys import LAYOUTS, Namespace

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
_SAME_SIZE = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}  # numpy has no bf16


def block_view(namespace: Namespace, raw: np.ndarray) -> torch.Tensor:
    """A uint8 buffer of n whole blocks seen as [n, L, 2, T, H, D] in the model dtype (no copy)."""
    if namespace.layout != LAYOUTS[0]:
        raise KVStoreError("invalid", f"blocks of layout {namespace.layout!r} are bytes to this client: "
                           "save_blocks / load_blocks, not the tensor API")
    n = raw.nbytes // namespace.block_nbytes
    assert n * namespace.block_nbytes == raw.nbytes, "buffer is not a whole number of blocks"
    flat = torch.from_numpy(raw).view(TORCH_DTYPES[namespace.dtype])
    return flat.view(n, namespace.num_layers, 2, namespace.block_tokens, namespace.num_kv_heads, namespace.head_dim)


def check_kv(namespace: Namespace, kv: LayerKV, seq_len: int) -> None:
    """Refuse, with a clear message, KV that does not match the namespace."""
    if len(kv) != namespace.num_layers:
        raise KVStoreError("invalid", f"expected {namespace.num_layers} layers of (K, V), got {len(kv)}")
    want_shape = (namespace.num_kv_heads, seq_len, namespace.head_dim)
    want_dtype = TORCH_DTYPES[namespace.dtype]
    for layer, pair in enumerate(kv):
        if len(pair) != 2:
            raise KVStoreError("invalid", f"layer {layer}: expected a (K, V) pair")
        for name, tensor in zip("KV", pair):
            if not isinstance(tensor, torch.Tensor):
                raise KVStoreError("invalid", f"layer {layer} {name}: expected a torch tensor")
            if tuple(tensor.shape) != want_shape:
                raise KVStoreError("invalid", f"layer {layer} {name}: shape {tuple(tensor.shape)}, "
                                   f"expected [num_kv_heads, seq_len, head_dim] = {list(want_shape)}")
            if tensor.dtype != want_dtype:
                raise KVStoreError("invalid", f"layer {layer} {name}: dtype {tensor.dtype}, "
                                   f"the namespace says {namespace.dtype}")


def pack_copies(namespace: Namespace, kv: LayerKV, first_block: int, raw: np.ndarray) -> list[Callable[[], None]]:
    """The copies that put blocks first_block .. of `kv` into whole blocks `raw` (bytes, the store's
    layout), one per layer and K or V: [H, n x T, D] -> [n, T, H, D]. numpy copies without the GIL,
    so they may run on several threads, straight into a worker's mapped arena where they can;
    tensors on a GPU are copied by PyTorch."""
    blocks, n, t = _blocks(namespace, raw)
    copies = []
    for layer, pair in enumerate(kv if n else []):
        for which, tensor in enumerate(pair):
            theirs = tensor.detach()[:, first_block * t:(first_block + n) * t]
            if theirs.device.type != "cpu":
                out = torch.from_numpy(blocks[:, layer, which]).view(theirs.dtype)
                copies.append(partial(out.copy_, theirs.reshape(namespace.num_kv_heads, n, t, -1).permute(1, 2, 0, 3)))
                continue
            theirs = theirs.view(_SAME_SIZE[theirs.element_size()][1]).numpy().reshape(
                namespace.num_kv_heads, n, t, namespace.head_dim)
            copies.append(partial(np.copyto, blocks[:, layer, which], theirs.transpose(1, 2, 0, 3)))
    return copies


def _blocks(namespace: Namespace, raw: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Whole blocks `raw` seen as [n, L, 2, T, H, D] of an integer type of the dtype's size; n; T."""
    n, t = raw.nbytes // namespace.block_nbytes, namespace.block_tokens
    itemsize = TORCH_DTYPES[namespace.dtype].itemsize
    return raw[:n * namespace.block_nbytes].view(_SAME_SIZE[itemsize][0]).reshape(
        n, namespace.num_layers, 2, t, namespace.num_kv_heads, namespace.head_dim), n, t


def unpack_copies(namespace: Namespace, raw: np.ndarray, first_block: int, kv: LayerKV) -> list[Callable[[], None]]:
    """The copies that put whole blocks `raw` (bytes, the store's layout) into token positions
    first_block x T .. of the per-layer tensors `kv`: one numpy copy per layer and K or V,
    [n, T, H, D] -> [H, n x T, D]. numpy copies without the GIL, so they may run on several
    threads; they are read straight out of a worker's mapped arena where they can be."""
    blocks, n, t = _blocks(namespace, raw)
    if not n:
        return []
    itemsize = TORCH_DTYPES[namespace.dtype].itemsize
    copies = []
    for layer, pair in enumerate(kv):
        for which, tensor in enumerate(pair):
            here = tensor[:, first_block * t:(first_block + n) * t].view(_SAME_SIZE[itemsize][1]).numpy()
            copies.append(partial(np.copyto, here.reshape(namespace.num_kv_heads, n, t, namespace.head_dim),
                                  blocks[:, layer, which].transpose(2, 0, 1, 3)))
    return copies


def packer(namespace: Namespace, kv: LayerKV, first_block: int) -> Callable:
    """(k, bytes of blocks first_block + k ..) -> the copies that pack them from `kv`."""
    return lambda k, raw: pack_copies(namespace, kv, first_block + k, raw)


def unpacker(namespace: Namespace, kv: LayerKV, first_block: int) -> Callable:
    """(k, bytes of blocks first_block + k ..) -> the copies that unpack them into `kv`."""
    return lambda k, raw: unpack_copies(namespace, raw, first_block + k, kv)


def empty_kv(namespace: Namespace, num_tokens: int) -> LayerKV:
    shape = (namespace.num_kv_heads, num_tokens, namespace.head_dim)
    dtype = TORCH_DTYPES[namespace.dtype]
    return [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(namespace.num_layers)]
