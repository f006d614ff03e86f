"""vLLM's block hashes, computed without vLLM, so that operator tools can look up a prompt in a
namespace whose keys vLLM made.

vLLM names block i `h_i = H((h_{i-1}, tuple(tokens_i), extra_keys))` with `h_{-1} = NONE_HASH =
H(seed)`, where H is its `prefix_caching_hash_algo` (pickle or canonical CBOR, then SHA-256 or
xxh3_128) and the seed is PYTHONHASHSEED when the engines set it, "vllm-none-hash" otherwise (the
xxhash algorithms draw a random seed per process then, and their keys cannot be recomputed).
The namespace's `hash_scheme`, `vllm-<algo>-none:<xxh64 of NONE_HASH>`, names the algorithm and
fingerprints NONE_HASH, so a wrong seed is caught here instead of showing as a miss. Prompts with
extra keys (LoRA, multimodal inputs, cache salt) hash differently and are not covered.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

import xxhash

from kvstore.core.errors import KVStoreError

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def parse_scheme(scheme: str) -> tuple[str, str] | None:
    """(algorithm, NONE_HASH fingerprint) of a vLLM namespace's hash scheme; None for any other scheme."""
    if not scheme.startswith("vllm-") or "-none:" not in scheme:
        return None
    algo, fingerprint = scheme[len("vllm-"):].rsplit("-none:", 1)
    return algo, fingerprint


def _serialize(algo: str, value) -> bytes:
    if algo.endswith("_cbor"):
        try:
            import cbor2
        except ImportError:
            raise KVStoreError("unavailable", f"hashing like vLLM's {algo} needs cbor2: pip install cbor2") from None
        return cbor2.dumps(value, canonical=True)
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _hash(algo: str, value) -> bytes:
    data = _serialize(algo, value)
    return hashlib.sha256(data).digest() if algo.startswith("sha256") else xxhash.xxh3_128_digest(data)


def block_hashes(scheme: str, block_tokens: int, token_ids: Sequence[int], seed: str | None = None) -> list[str]:
    """The hex hashes vLLM gives every full block of `token_ids` in a namespace of this scheme."""
    parsed = parse_scheme(scheme)
    if parsed is None:
        raise KVStoreError("invalid", f"{scheme!r} is not a vLLM hash scheme")
    algo, fingerprint = parsed
    if algo not in ALGORITHMS:
        raise KVStoreError("invalid", f"unknown vLLM hash algorithm {algo!r}", known=list(ALGORITHMS))
    parent = _hash(algo, seed if seed is not None else DEFAULT_SEED)
    if xxhash.xxh64_hexdigest(parent) != fingerprint:
        hint = ("its engines draw a random seed per process (xxhash without PYTHONHASHSEED): its keys cannot "
                "be recomputed" if algo.startswith("xxhash") and seed is None else
                "pass the engines' PYTHONHASHSEED with --hash-seed")
        raise KVStoreError("invalid", f"this seed does not give the namespace's NONE_HASH: {hint}")
    hashes = []
    for start in range(0, len(token_ids) // block_tokens * block_tokens, block_tokens):
        parent = _hash(algo, (parent, tuple(token_ids[start:start + block_tokens]), None))
        hashes.append(parent.hex())
    return hashes
