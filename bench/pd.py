"""Prefill/decode hand-off through the store: its latency, and the decode instance's time to first
token against computing the prompt on the decode instance.

    python bench/pd.py [--prompts 1024,4096,16384] [--layers 8] [--repeats 3] [--json OUT]

The reference model (bench/ttft.py's randomly initialised Llama, CPU, float32) plays both
instances, each with its own store client (its own NIXL agent) against a local stack (directory
and one DRAM worker, as processes). Per repeat a new prompt arrives at both at once: the decode
side starts waiting for the hand-off (`load(wait_for=ID)`), the prefill side computes the prompt
and samples its first token ("P finished"), saves the KV and commits the hand-off; the decode
side wakes, loads every block and computes the last prompt token, whose logits give the first
token. "recompute" is the decode side computing the whole prompt itself.

Reported (medians over --repeats): P's prefill; the hand-off latency (P finished -> the KV is in
D's memory), split into save (P's NIXL write, checksums and commit), wake (commit -> D's wait
returns) and load (D's prepare, NIXL read, checksum, complete, unpack); D's time to first token
after P finished (hand-off latency + the last token's forward) against recompute; and the P/D
queue time of D's request (how long it waited). Every run's first token and logits are checked
against the prefill's. JSON + a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, print_table, write_json  # noqa: E402
from ttft import BLOCK_TOKENS, build_model, tokens  # noqa: E402

from kvstore.connector import KVStoreClient, Namespace  # noqa: E402
from kvstore.connector.hf import from_dynamic_cache, to_dynamic_cache  # noqa: E402
from kvstore.core.sizes import format_size  # noqa: E402

PHASES = ("prefill", "save", "wake", "load", "last_token", "handoff", "ttft_handoff", "recompute", "queue")


@torch.no_grad()
def decode_side(client: KVStoreClient, model, prompt: list[int], handoff: str, out: dict) -> None:
    """Waits for the hand-off, loads the KV, computes the last prompt token: D's first token."""
    started = time.perf_counter()
    kv, n = client.load(prompt, wait_for=handoff, timeout=120)
    out["woke"] = started + client.last_handoff.waited_s
    out["visible"], out["outcome"], out["loaded"] = time.perf_counter(), client.last_handoff.outcome, n
    n = min(n, len(prompt) - 1)
    cache = to_dynamic_cache([(k[:, :n], v[:, :n]) for k, v in kv], model.config)
    out["logits"] = model(torch.tensor([prompt[n:]]), past_key_values=cache, use_cache=True).logits[0, -1]
    out["first"] = time.perf_counter()
    out["started"] = started


@torch.no_grad()
def one_run(url: str, model, ns: Namespace, prompt: list[int], handoff: str, staging: int) -> dict:
    with KVStoreClient(url, ns, staging_bytes=staging) as p, KVStoreClient(url, ns, staging_bytes=staging) as d:
        seen: dict = {}
        consumer = threading.Thread(target=decode_side, args=(d, model, prompt, handoff, seen))
        consumer.start()  # the router sent the request to both; the decode side waits
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        finished = time.perf_counter()
        saved = p.save(prompt, from_dynamic_cache(out.past_key_values), handoff=handoff)
        committed = time.perf_counter()
        consumer.join()
    assert saved == len(prompt) and seen["outcome"] == "committed" and seen["loaded"] == len(prompt), seen
    reference = out.logits[0, -1]
    assert int(seen["logits"].argmax()) == int(reference.argmax()), "the decode side's first token differs"
    t1 = time.perf_counter()
    with torch.no_grad():
        recomputed = model(torch.tensor([prompt])).logits[0, -1]
    recompute = time.perf_counter() - t1
    assert int(recomputed.argmax()) == int(reference.argmax())
    return {"prefill": finished - t0, "save": committed - finished, "wake": max(0.0, seen["woke"] - committed),
            "load": seen["visible"] - max(seen["woke"], committed), "last_token": seen["first"] - seen["visible"],
            "handoff": seen["visible"] - finished, "ttft_handoff": seen["first"] - finished, "recompute": recompute,
            "queue": seen["woke"] - seen["started"],
            "max_abs_logit_diff": float((seen["logits"] - reference).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="1024,4096,16384", help="prompt lengths in tokens")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench/out/pd.json")
    args = parser.parse_args()
    try:
        prompts = [int(p) for p in args.prompts.split(",")]
    except ValueError:
        sys.exit("error: --prompts takes comma-separated token counts")
    if any(p <= 0 or p % BLOCK_TOKENS for p in prompts) or args.layers < 1 or args.repeats < 1:
        sys.exit(f"error: prompts must be positive multiples of {BLOCK_TOKENS} tokens; --layers and --repeats "
                 "positive")
    model = build_model(args.layers, max(prompts) + 1)
    c = model.config
    ns = Namespace(model_id=f"bench-pd-{args.layers}", num_layers=c.num_hidden_layers,
                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype="float32", block_tokens=BLOCK_TOKENS)
    kv_bytes = max(prompts) // BLOCK_TOKENS * ns.block_nbytes
    dram = format_size(args.repeats * sum(p // BLOCK_TOKENS * ns.block_nbytes for p in prompts) + (64 << 20))
    results = []
    with local_stack(dram_bytes=dram.replace(" ", ""), page_bytes=str(ns.block_nbytes)) as url:
        for prompt_tokens in prompts:
            print(f"prompt {prompt_tokens} tokens ...", flush=True)
            runs = [one_run(url, model, ns, tokens(prompt_tokens, seed=1000 * prompt_tokens + r),
                            f"pd-{prompt_tokens}-{r}", kv_bytes + ns.block_nbytes) for r in range(args.repeats)]
            row = {k: statistics.median(run[k] for run in runs) for k in PHASES}
            row.update(prompt_tokens=prompt_tokens, kv_bytes=prompt_tokens // BLOCK_TOKENS * ns.block_nbytes,
                       speedup=row["recompute"] / row["ttft_handoff"],
                       max_abs_logit_diff=max(run["max_abs_logit_diff"] for run in runs))
            results.append(row)
    print()
    print_table(["prompt", "KV", "P prefill ms", "hand-off ms", "save", "wake", "load", "D last token ms",
                 "D TTFT ms", "D recompute ms", "speedup", "max |dlogit|"],
                [[r["prompt_tokens"], format_size(r["kv_bytes"]), r["prefill"] * 1e3, r["handoff"] * 1e3,
                  r["save"] * 1e3, r["wake"] * 1e3, r["load"] * 1e3, r["last_token"] * 1e3, r["ttft_handoff"] * 1e3,
                  r["recompute"] * 1e3, r["speedup"], f"{r['max_abs_logit_diff']:.1e}"] for r in results])
    write_json(args.json, {"benchmark": "pd", "machine": machine(), "layers": args.layers,
                           "block_tokens": BLOCK_TOKENS, "repeats": args.repeats, "results": results})
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
