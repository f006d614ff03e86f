"""Namespaces and chained block hashes.

A `Namespace` is everything that makes two KV blocks interchangeable. Block i
of a token sequence is named by `h_i = xxh3_128(h_{i-1} || tokens_i)` with
`h_{-1} = seed(namespace)` and tokens as little-endian int32, so `h_i` names
the whole prefix up to block i and two namespaces never share a hash.
Only full blocks are hashed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import xxhash

from kvstore.core.errors import KVStoreError

if TYPE_CHECKING:
    import numpy as np

HASH_SCHEME = "kvstore-xxh3_128-int32le-v1"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# [L][K,V][T][H][D] (KVStoreClient), vLLM's per-layer pages [L][H][T][K|V] (HND) and [L][T][H][K|V] (NHD)
# (connector.vllm), and SGLang's host pages (connector.sglang): [K,V][T][L][H][D] (page_first),
# [K,V][L][T][H][D] (layer_first, page_first_direct)
LAYOUTS = ("layer_kv_token_head_dim", "layer_head_token_kvdim", "kv_token_layer_head_dim", "kv_layer_token_head_dim",
           "layer_token_head_kvdim")
RAW_LAYOUTS = ("kv_token_layer_head_dim", "kv_layer_token_head_dim")  # moved as bytes by their connector, never packed
VLLM_LAYOUTS = ("layer_head_token_kvdim", "layer_token_head_kvdim")  # vLLM's pages: HND, NHD
MAX_BLOCK_BYTES = 1 << 30  # one block's payload
MAX_NAME_CHARS = 256  # model_id, model_revision, tenant
DIMENSIONS = ("num_layers", "num_kv_heads", "head_dim", "block_tokens")


@dataclasses.dataclass(frozen=True)
class Namespace:
    """What a KV block means. Fields and their valid ranges:

    model_id: non-empty string; num_layers, num_kv_heads, head_dim: 1..65536;
    dtype: one of DTYPE_BYTES; block_tokens: 1..65536, and a block at most 1 GiB;
    tp/pp rank < size; tenant: cache salt, any string ('' = shared). Strings: at
    most 256 characters.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    model_revision: str = ""
    layout: str = LAYOUTS[0]
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tenant: str = ""
    hash_scheme: str = HASH_SCHEME

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise KVStoreError("invalid", "invalid namespace: " + "; ".join(problems))

    def _problems(self):
        if not isinstance(self.model_id, str) or not self.model_id:
            yield "model_id must be a non-empty string"
        for name in (*DIMENSIONS, "tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65536:
                yield f"{name} must be an integer in 1..65536, got {value!r}"
        for name in ("model_id", "model_revision", "tenant", "hash_scheme"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
                yield f"{name} must be a string of at most {MAX_NAME_CHARS} characters"
        if self.dtype not in DTYPE_BYTES:
            yield f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
        elif all(isinstance(getattr(self, n), int) for n in DIMENSIONS) and self.block_nbytes > MAX_BLOCK_BYTES:
            yield f"a block of these dimensions holds {self.block_nbytes} bytes; at most {MAX_BLOCK_BYTES}"
        if self.layout not in LAYOUTS:
            yield f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}"
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, s = getattr(self, rank), getattr(self, size)
            if not isinstance(r, int) or not isinstance(s, int) or not 0 <= r < s:
                yield f"{rank} must be in 0..{size}-1, got {r!r}"

    def canonical_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @cached_property
    def namespace_id(self) -> str:
        """xxh3_64 of the canonical JSON, 16 hex digits."""
        return xxhash.xxh3_64_hexdigest(self.canonical_json().encode())

    @cached_property
    def seed(self) -> bytes:
        return xxhash.xxh3_128_digest(self.canonical_json().encode())

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_nbytes(self) -> int:
        """2 * L * T * H * D * sizeof(dtype)."""
        return self.num_layers * self.block_tokens * self.layer_token_nbytes

    @property
    def layer_token_nbytes(self) -> int:
        """Bytes of K+V for one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def json_schema(cls) -> dict:
        """The JSON schema of `from_dict`'s input: every field, its type, range or values."""
        integer = {"type": "integer"}
        props = {f.name: dict(integer) if f.type == "int" else {"type": "string", "maxLength": MAX_NAME_CHARS}
                 for f in dataclasses.fields(cls)}
        for name in (*DIMENSIONS, "tp_size", "pp_size"):
            props[name].update(minimum=1, maximum=65536)
        for name in ("tp_rank", "pp_rank"):
            props[name]["minimum"] = 0
        props["model_id"]["minLength"] = 1
        props["dtype"] = {"type": "string", "enum": sorted(DTYPE_BYTES)}
        props["layout"] = {"type": "string", "enum": list(LAYOUTS), "default": LAYOUTS[0]}
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False,
                "description": "what a KV block means: a block is at most 1 GiB; each rank below its size"}

    @classmethod
    def from_dict(cls, data: dict) -> "Namespace":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise KVStoreError("invalid", f"unknown namespace fields: {sorted(unknown)}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise KVStoreError("invalid", f"a namespace needs {', '.join(missing)}", missing=missing)
        integers = {f.name for f in dataclasses.fields(cls) if f.type == "int"}  # 5.0 is JSON's integer 5
        data = {k: int(v) if k in integers and isinstance(v, float) and v.is_integer() else v for k, v in data.items()}
        try:
            return cls(**data)
        except TypeError as exc:
            raise KVStoreError("invalid", f"invalid namespace: {exc}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def num_full_blocks(num_tokens: int, block_tokens: int) -> int:
    return num_tokens // block_tokens


def block_hashes(namespace: Namespace, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
    """The chained 16-byte hashes of every full block of `token_ids`."""
    import numpy as np  # here: the directory, which never hashes tokens, runs without it (16 MiB)

    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise KVStoreError("invalid", "token ids must be a flat sequence", shape=list(tokens.shape))
    if tokens.size and (tokens.min() < -(2**31) or tokens.max() >= 2**31):
        raise KVStoreError("invalid", "token ids must fit in int32")
    data = tokens.astype("<i4", copy=False).tobytes()
    step = namespace.block_tokens * 4
    hashes: list[bytes] = []
    previous = namespace.seed
    for start in range(0, num_full_blocks(tokens.size, namespace.block_tokens) * step, step):
        previous = xxhash.xxh3_128_digest(previous + data[start : start + step])
        hashes.append(previous)
    return hashes


def checksum(data) -> str:
    """xxh3_64 of a block's bytes (anything exposing the buffer protocol), 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)
