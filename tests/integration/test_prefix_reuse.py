"""Engine A saves a prompt's KV; engine B, another process with its own NIXL agent, loads it over
UCX from the worker, computes only the rest, and gets the logits of a full prefill."""

from __future__ import annotations

from kvstore.client import DirectoryClient
from tests.integration.engine import BLOCK_TOKENS, CONTINUATION_TOKENS, PROMPT_TOKENS


def test_prefix_saved_by_one_engine_is_loaded_by_another(running_stack, tmp_path):
    saved = running_stack.run_engine("save", tmp_path)
    full_blocks = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
    assert saved == {"stored_tokens": full_blocks, "stored_again": full_blocks}

    loaded = running_stack.run_engine("load", tmp_path)
    assert loaded["hit_tokens"] == full_blocks
    assert loaded["loaded_tokens"] == full_blocks
    assert loaded["computed_tokens"] == PROMPT_TOKENS + CONTINUATION_TOKENS - full_blocks
    assert loaded["max_abs_diff"] <= 1e-4, loaded
    assert loaded["perturbed_kv_diff"] > 1e-3, loaded  # the check is sensitive to wrong KV
    assert loaded["other_model_hit"] == 0 and loaded["other_layout_hit"] == 0

    stats = DirectoryClient(running_stack.url).stats()
    assert stats.blocks == full_blocks // BLOCK_TOKENS
    assert (stats.reservations, stats.leases_active, stats.pins) == (0, 0, 0)
