"""Layer-wise load: every layer's read posted at once, each layer handed to the model just before
it runs; the logits equal a full prefill and every layer's timings are recorded."""

from __future__ import annotations

import pytest
import torch

from kvstore.connector import KVStoreClient
from kvstore.connector.hf import layerwise_cache
from tests.integration.engine import (BLOCK_TOKENS, CONTINUATION_TOKENS, PROMPT_TOKENS, build_model, namespace_of,
                                      tokens)

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.mark.parametrize("same_host", ["auto", "off"])  # copied with the worker's arena, or read over NIXL
@torch.no_grad()
def test_a_layerwise_load_feeds_each_layer_just_in_time_and_matches_a_full_prefill(running_stack, tmp_path,
                                                                                   same_host):
    assert running_stack.run_engine("save", tmp_path)["stored_tokens"] == FULL
    model = build_model()
    full = tokens(PROMPT_TOKENS, seed=1) + tokens(CONTINUATION_TOKENS, seed=10_001)
    with KVStoreClient(running_stack.url, namespace_of(model), staging_bytes=8 << 20, same_host=same_host) as client:
        load = client.start_load_layers(full)
        assert load.num_tokens == FULL
        with layerwise_cache(model, load) as cache:
            logits = model(torch.tensor([full[FULL:]]), past_key_values=cache, use_cache=True).logits[0, -1]
        assert load.finish() == FULL // BLOCK_TOKENS  # every block verified after the fact
        timings = load.timings()
        copied = [load._hashes.hexdigest(i) is not None for i in range(len(load.hits))]  # hashed as copied
        assert copied == [same_host == "auto"] * (FULL // BLOCK_TOKENS)
        assert set(client.copier.arenas._arenas) == ({"worker-0"} if same_host == "auto" else set())
    reference = model(torch.tensor([full])).logits[0, -1]
    assert float((logits - reference).abs().max()) <= 1e-4
    layers = model.config.num_hidden_layers
    assert len(timings["t_xfer_s"]) == layers and all(t is not None and t > 0 for t in timings["t_xfer_s"])
    assert len(timings["t_visible_s"]) == layers and timings["t_post_s"] > 0
