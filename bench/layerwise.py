"""Layer-wise pipelining: how much of the KV transfer the model's own compute hides.

    python bench/layerwise.py [--prefix-tokens 4096] [--suffix-tokens 64] [--layers 16] [--repeats 5] [--json OUT]

A randomly initialised Llama (HF transformers, CPU) saves the KV of a prefix into a local stack
(directory + worker processes); then, per repeat, a second client posts every layer's read at
once (`start_load_layers`) and runs the suffix through the model with each decoder layer waiting
only for its own layer (`layerwise_cache`). Per layer: T_xfer (post -> read complete) and
T_visible (time the layer actually waited). Overlap = 1 - sum(T_visible) / sum(T_xfer): 1 means
the transfer was fully hidden behind compute, 0 that the model waited for all of it. For
comparison the same load is also run all-layers-first (`client.load`, then the forward).
Medians over repeats; JSON + a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, print_table, write_json  # noqa: E402

from kvstore.connector import KVStoreClient, Namespace  # noqa: E402
from kvstore.connector.hf import from_dynamic_cache, layerwise_cache, to_dynamic_cache  # noqa: E402

BLOCK_TOKENS = 16


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=16384, torch_dtype="float32")
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def run(args) -> dict:
    model = build_model(args.layers)
    c = model.config
    ns = Namespace(model_id=f"bench-layerwise-{args.layers}", num_layers=c.num_hidden_layers,
                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype="float32",
                   block_tokens=BLOCK_TOKENS)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, c.vocab_size, (args.prefix_tokens,), generator=g).tolist()
    suffix = torch.randint(0, c.vocab_size, (args.suffix_tokens,), generator=g).tolist()
    staging = (args.prefix_tokens // BLOCK_TOKENS + 1) * ns.block_nbytes
    kv_bytes = args.prefix_tokens // BLOCK_TOKENS * ns.block_nbytes
    with local_stack(dram_bytes=str(2 * kv_bytes + (64 << 20)), page_bytes="256KiB") as url:
        with KVStoreClient(url, ns, staging_bytes=staging) as writer:
            out = model(torch.tensor([prefix]), use_cache=True)
            assert writer.save(prefix, from_dynamic_cache(out.past_key_values)) == args.prefix_tokens
        rows = []
        with KVStoreClient(url, ns, staging_bytes=staging) as reader:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                load = reader.start_load_layers(prefix + suffix)
                with layerwise_cache(model, load) as cache:
                    model(torch.tensor([suffix]), past_key_values=cache, use_cache=True)
                verified = load.finish()
                layerwise_s = time.perf_counter() - t0
                assert verified * BLOCK_TOKENS == args.prefix_tokens, "the bench needs a full hit"
                t = load.timings()
                t0 = time.perf_counter()
                kv, n = reader.load(prefix + suffix)
                model(torch.tensor([suffix]), past_key_values=to_dynamic_cache(kv, c), use_cache=True)
                serial_s = time.perf_counter() - t0
                rows.append({"t_post_s": t["t_post_s"], "t_xfer_s": t["t_xfer_s"], "t_visible_s": t["t_visible_s"],
                             "layerwise_s": layerwise_s, "serial_s": serial_s})
    xfer = [sum(r["t_xfer_s"]) for r in rows]
    visible = [sum(r["t_visible_s"]) for r in rows]
    overlap = [1 - v / x for v, x in zip(visible, xfer)]
    return {"layers": args.layers, "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
            "kv_bytes": kv_bytes, "repeats": rows, "median_overlap": statistics.median(overlap),
            "median_sum_xfer_s": statistics.median(xfer), "median_sum_visible_s": statistics.median(visible),
            "median_layerwise_s": statistics.median(r["layerwise_s"] for r in rows),
            "median_serial_s": statistics.median(r["serial_s"] for r in rows),
            "median_per_layer": [{"layer": i, "t_xfer_s": statistics.median(r["t_xfer_s"][i] for r in rows),
                                  "t_visible_s": statistics.median(r["t_visible_s"][i] for r in rows)}
                                 for i in range(args.layers)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench/out/layerwise.json")
    args = parser.parse_args()
    if args.prefix_tokens % BLOCK_TOKENS or args.prefix_tokens <= 0 or args.suffix_tokens <= 0 or args.repeats < 1:
        sys.exit(f"error: --prefix-tokens must be a positive multiple of {BLOCK_TOKENS}; --suffix-tokens and "
                 "--repeats positive")
    result = run(args)
    print_table(["layer", "T_xfer ms", "T_visible ms"],
                [[p["layer"], f'{p["t_xfer_s"] * 1e3:.2f}', f'{p["t_visible_s"] * 1e3:.2f}']
                 for p in result["median_per_layer"]])
    print(f"\nKV {result['kv_bytes'] / 2**20:.0f} MiB over {args.layers} layers; medians of {args.repeats}: "
          f"sum T_xfer {result['median_sum_xfer_s'] * 1e3:.1f} ms, sum T_visible "
          f"{result['median_sum_visible_s'] * 1e3:.1f} ms, overlap {result['median_overlap']:.2f}; "
          f"load+forward layer-wise {result['median_layerwise_s'] * 1e3:.1f} ms vs all-layers-first "
          f"{result['median_serial_s'] * 1e3:.1f} ms")
    write_json(args.json, {"benchmark": "layerwise", "machine": machine(), **result})


if __name__ == "__main__":
    main()
