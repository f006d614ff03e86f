"""KVStoreConnector against the real vLLM 0.33 classes on the CPU (make setup-vllm): the factory
builds both roles from a VllmConfig, and two engine processes driven through vLLM's call order
move a prompt's paged KV through a real kvstore stack."""

from __future__ import annotations

import os

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvstore.connector.vllm import KVStoreConnector
from kvstore.core.errors import KVStoreError
from kvstore.client import DirectoryClient
from tests_vllm.engine import BLOCK, PROMPT_TOKENS, configs, prompt

FULL_BLOCKS = PROMPT_TOKENS // BLOCK  # 10; a load leaves the last token to compute: all 10 fit


def test_the_factory_builds_both_roles_from_a_vllm_config():
    vllm_config, kv_cache_config = configs("http://127.0.0.1:1", "sha256")
    assert vllm_config.kv_transfer_config.kv_connector_module_path == "kvstore.connector.vllm"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        connector = KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)
        assert isinstance(connector, KVStoreConnector) and connector.role == role
        connector.shutdown()


def test_a_config_without_directory_url_is_refused_with_one_clear_message():
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connector.vllm",
                                kv_role="kv_both")
    vllm_config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK))
    _, kv_cache_config = configs("http://127.0.0.1:1", "sha256")
    with pytest.raises(KVStoreError, match="needs directory_url"):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_engine_b_loads_what_engine_a_saved_into_other_block_ids(stack):
    saved = stack.engine("save", "--first-block", "3")
    assert (saved["matched_tokens"], saved["load_errors"]) == (0, [])  # nothing cached before
    loaded = stack.engine("load", "--first-block", "40")
    assert loaded["matched_tokens"] == FULL_BLOCKS * BLOCK and loaded["load_async"] is False
    assert loaded["load_errors"] == [] and loaded["sources"] == {"host": FULL_BLOCKS * BLOCK}  # from DRAM
    assert loaded["loaded_blocks_equal"] == [True] * FULL_BLOCKS  # B's pages 40.. equal A's pages 3..
    assert loaded["keys"] == saved["keys"] and loaded["namespace_id"] == saved["namespace_id"]


def test_a_failed_load_is_reported_as_failed_never_as_loaded(stack):
    stack.engine("save", "--first-block", "3")
    failed = stack.engine("load", "--first-block", "40", "--evict-before-load")  # gone after the lookup
    assert failed["matched_tokens"] == FULL_BLOCKS * BLOCK
    assert failed["load_errors"] == failed["block_ids"][:FULL_BLOCKS]
    assert not any(failed["loaded_blocks_equal"])


def test_an_asynchronous_load_is_reported_by_get_transfer_results(stack):
    stack.engine("save", "--first-block", "3")
    loaded = stack.engine("load", "--first-block", "40", "--load-async")
    assert loaded["matched_tokens"] == FULL_BLOCKS * BLOCK and loaded["load_async"] is True
    assert (loaded["finished_recving"], loaded["failed_recving"], loaded["load_errors"]) == (["req-load"], [], [])
    assert loaded["loaded_blocks_equal"] == [True] * FULL_BLOCKS


def test_a_failed_asynchronous_load_is_in_failed_recving_and_its_blocks_in_load_errors(stack):
    stack.engine("save", "--first-block", "3")
    failed = stack.engine("load", "--first-block", "40", "--load-async", "--evict-before-load")
    assert failed["finished_recving"] == ["req-load"] and failed["failed_recving"] == ["req-load"]
    assert failed["load_errors"] == failed["block_ids"][:FULL_BLOCKS]
    assert not any(failed["loaded_blocks_equal"])


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "xxhash_cbor"])
def test_stored_keys_are_vllms_own_block_hashes(stack, algo):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    env = {**os.environ, "PYTHONHASHSEED": "1234"}  # xxhash seeds NONE_HASH from it (else at random)
    saved = stack.engine("save", "--hash", algo, env=env)
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
    assert saved["keys"][:FULL_BLOCKS] == expected
    assert DirectoryClient(stack.url).lookup(saved["namespace_id"], expected).num_hit_blocks == FULL_BLOCKS
