"""The reference engine: a small randomly initialised Llama (fixed seed, no downloads).

    python -m tests.integration.engine save --url URL --out result.json [--prompt-seed N]
    python -m tests.integration.engine load --url URL --out result.json [--prompt-seed N]

`save` prefills the prompt and saves its KV. `load` looks up prompt + continuation,
loads the cached prefix, computes only the remaining tokens and compares the
next-token logits with a full prefill. Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstore.connector import KVStoreClient, Namespace
from kvstore.connector.hf import from_dynamic_cache, to_dynamic_cache

PROMPT_TOKENS, CONTINUATION_TOKENS, BLOCK_TOKENS = 1040, 29, 16


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, torch_dtype="float32")
    return LlamaForCausalLM(config).eval()


def namespace_of(model: LlamaForCausalLM, model_id: str = "tiny-llama-seed0") -> Namespace:
    c = model.config
    return Namespace(model_id=model_id, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, dtype="float32", block_tokens=BLOCK_TOKENS)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


@torch.no_grad()
def save(url: str, prompt_seed: int = 1) -> dict:
    model = build_model()
    prompt = tokens(PROMPT_TOKENS, seed=prompt_seed)
    out = model(torch.tensor([prompt]), use_cache=True)
    with KVStoreClient(url, namespace_of(model)) as client:
        stored = client.save(prompt, from_dynamic_cache(out.past_key_values))
        again = client.save(prompt, from_dynamic_cache(out.past_key_values))
    return {"stored_tokens": stored, "stored_again": again}


@torch.no_grad()
def load(url: str, prompt_seed: int = 1) -> dict:
    model = build_model()
    full = tokens(PROMPT_TOKENS, seed=prompt_seed) + tokens(CONTINUATION_TOKENS, seed=10_000 + prompt_seed)
    with KVStoreClient(url, namespace_of(model)) as client:
        hit = client.lookup(full)
        t0 = time.perf_counter()
        kv, n = client.load(full)
        load_s = time.perf_counter() - t0
        cache = to_dynamic_cache(kv, model.config)
        cached = model(torch.tensor([full[n:]]), past_key_values=cache, use_cache=True).logits[0, -1]
        # the same computation over slightly wrong KV, to show the comparison can fail
        wrong = to_dynamic_cache([(k, v + 1e-2 * torch.randn_like(v)) for k, v in kv], model.config)
        perturbed = model(torch.tensor([full[n:]]), past_key_values=wrong, use_cache=True).logits[0, -1]
    reference = model(torch.tensor([full])).logits[0, -1]
    with KVStoreClient(url, namespace_of(model, model_id="another-model")) as other:
        other_hit = other.lookup(full)
    layout = Namespace(**{**namespace_of(model).to_dict(), "num_kv_heads": 1, "head_dim": 32})
    with KVStoreClient(url, layout) as other_layout:
        other_layout_hit = other_layout.lookup(full)
    return {"hit_tokens": hit, "loaded_tokens": n, "computed_tokens": len(full) - n, "load_s": load_s,
            "max_abs_diff": float((cached - reference).abs().max()),
            "perturbed_kv_diff": float((perturbed - reference).abs().max()), "other_model_hit": other_hit,
            "other_layout_hit": other_layout_hit, "pid": os.getpid()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompt-seed", type=int, default=1)
    args = parser.parse_args()
    result = (save if args.mode == "save" else load)(args.url, args.prompt_seed)
    with open(args.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
