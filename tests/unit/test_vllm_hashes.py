"""vLLM's block hashes computed without vLLM (compared with vLLM's own in tests_vllm): the seed is
checked against the namespace's fingerprint, and what cannot be recomputed says why."""

from __future__ import annotations

import hashlib
import pickle

import pytest
import xxhash

from kvstore.core import vllm_hashes
from kvstore.core.errors import KVStoreError


def scheme(algo: str, seed: str) -> str:
    return f"vllm-{algo}-none:{xxhash.xxh64_hexdigest(vllm_hashes._hash(algo, seed))}"


def test_the_chain_is_vllms_formula():
    tokens = list(range(10))
    none = hashlib.sha256(pickle.dumps(vllm_hashes.DEFAULT_SEED, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    first = hashlib.sha256(pickle.dumps((none, (0, 1, 2, 3), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, (4, 5, 6, 7), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert vllm_hashes.block_hashes(scheme("sha256", vllm_hashes.DEFAULT_SEED), 4, tokens) == [first.hex(),
                                                                                                 second.hex()]


@pytest.mark.parametrize("algo", vllm_hashes.ALGORITHMS)
def test_every_algorithm_chains_and_checks_its_seed(algo):
    hashes = vllm_hashes.block_hashes(scheme(algo, "42"), 2, [1, 2, 3, 4, 5], seed="42")
    assert len(hashes) == 2 and len(set(hashes)) == 2
    assert len(bytes.fromhex(hashes[0])) == (32 if algo.startswith("sha256") else 16)
    with pytest.raises(KVStoreError) as wrong:
        vllm_hashes.block_hashes(scheme(algo, "42"), 2, [1, 2], seed="43")
    assert "--hash-seed" in wrong.value.message


def test_random_seeds_and_unknown_schemes_are_explained():
    with pytest.raises(KVStoreError) as random_seed:
        vllm_hashes.block_hashes("vllm-xxhash-none:0123456789abcdef", 2, [1, 2])
    assert "random seed per process" in random_seed.value.message
    with pytest.raises(KVStoreError) as unknown:
        vllm_hashes.block_hashes("vllm-md5-none:0123456789abcdef", 2, [1, 2])
    assert "unknown vLLM hash algorithm" in unknown.value.message
    assert vllm_hashes.parse_scheme("kvstore-xxh3_128-int32le-v1") is None
