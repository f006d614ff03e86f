"""The reference engine: a small randomly initialised Llama (fixed seed, no downloads).

    python -m tests.integration.engine save --url URL --out result.json [--prompt-seed N]
    python -m tests.integration.engine load --url URL --out result.json [--prompt-seed N]
    python -m tests.integration.engine prefill --handoff ID [--after FILE] [--delay-s S] ...
    python -m tests.integration.engine decode --handoff ID [--timeout-s S] [--steps N] [--waiting FILE] ...

`save` prefills the prompt and saves its KV. `load` looks up prompt + continuation,
loads the cached prefix, computes only the remaining tokens and compares the
next-token logits with a full prefill. `prefill` and `decode` are the two sides of a
hand-off: decode waits for the hand-off, loads the prompt's KV, computes only the tokens
the store did not hold (at least the last one, whose logits give the first token), decodes
N tokens greedily and compares both with a colocated prefill. Decode touches --waiting as it
starts to wait; prefill waits for --after to exist, then --delay-s. Results go to --out as JSON.
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
        pushed, read = client.pusher.pushed, client.pusher.read
    reference = model(torch.tensor([full])).logits[0, -1]
    with KVStoreClient(url, namespace_of(model, model_id="another-model")) as other:
        other_hit = other.lookup(full)
    layout = Namespace(**{**namespace_of(model).to_dict(), "num_kv_heads": 1, "head_dim": 32})
    with KVStoreClient(url, layout) as other_layout:
        other_layout_hit = other_layout.lookup(full)
    return {"hit_tokens": hit, "loaded_tokens": n, "computed_tokens": len(full) - n, "load_s": load_s,
            "max_abs_diff": float((cached - reference).abs().max()),
            "perturbed_kv_diff": float((perturbed - reference).abs().max()), "other_model_hit": other_hit,
            "other_layout_hit": other_layout_hit, "pid": os.getpid(), "pushed_blocks": pushed, "read_blocks": read}


@torch.no_grad()
def prefill(url: str, prompt_seed: int, handoff: str, delay_s: float = 0.0, after: str | None = None) -> dict:
    model = build_model()
    prompt = tokens(PROMPT_TOKENS, seed=prompt_seed)
    deadline = time.time() + 120  # a consumer that never waits: the test reads it in decode's result
    while after and not os.path.exists(after) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(delay_s)  # the consumer has been waiting meanwhile
    out = model(torch.tensor([prompt]), use_cache=True)
    finished_at = time.time()
    with KVStoreClient(url, namespace_of(model)) as client:
        stored = client.save(prompt, from_dynamic_cache(out.past_key_values), handoff=handoff)
    return {"stored_tokens": stored, "first_token": int(out.logits[0, -1].argmax()), "finished_at": finished_at,
            "committed_at": time.time()}


def greedy(model, logits: torch.Tensor, cache, steps: int) -> list[int]:
    generated = []
    for _ in range(steps):
        generated.append(int(logits.argmax()))
        out = model(torch.tensor([generated[-1:]]), past_key_values=cache, use_cache=True)
        logits, cache = out.logits[0, -1], out.past_key_values
    return generated


@torch.no_grad()
def decode(url: str, prompt_seed: int, handoff: str, timeout_s: float = 30.0, steps: int = 8,
           waiting: str | None = None) -> dict:
    model = build_model()
    prompt = tokens(PROMPT_TOKENS, seed=prompt_seed)
    with KVStoreClient(url, namespace_of(model)) as client:
        waiting_at = time.time()
        if waiting:
            open(waiting, "w").close()
        kv, n = client.load(prompt, wait_for=handoff, timeout=timeout_s)
        visible_at, waited = time.time(), client.last_handoff
    n = min(n, len(prompt) - 1)  # the last prompt token is computed here: its logits give the first token
    cache = to_dynamic_cache([(k[:, :n], v[:, :n]) for k, v in kv], model.config)
    out = model(torch.tensor([prompt[n:]]), past_key_values=cache, use_cache=True)
    first = out.logits[0, -1]
    generated = greedy(model, first, out.past_key_values, steps)
    colocated = model(torch.tensor([prompt]), use_cache=True)
    reference = greedy(model, colocated.logits[0, -1], colocated.past_key_values, steps)
    return {"outcome": waited.outcome, "waited_s": waited.waited_s, "waiting_at": waiting_at,
            "visible_at": visible_at, "loaded_tokens": n, "computed_tokens": len(prompt) - n,
            "first_logits_diff": float((first - colocated.logits[0, -1]).abs().max()),
            "generated": generated, "reference": reference}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "prefill", "decode"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompt-seed", type=int, default=1)
    parser.add_argument("--handoff", default="handoff-1")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--after", help="prefill: a file to wait for first")
    parser.add_argument("--waiting", help="decode: a file to create as it starts to wait")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.mode == "prefill":
        result = prefill(args.url, args.prompt_seed, args.handoff, args.delay_s, args.after)
    elif args.mode == "decode":
        result = decode(args.url, args.prompt_seed, args.handoff, args.timeout_s, args.steps, args.waiting)
    else:
        result = (save if args.mode == "save" else load)(args.url, args.prompt_seed)
    with open(args.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
