"""Time to first token with the prefix cached in DRAM, on NVMe and in S3, against a full prefill.

    python bench/ttft.py [--prompts 1024,4096,16384] [--new-tokens 64] [--layers 8] [--repeats 3] [--json OUT]

The reference model (a randomly initialised HF Llama, fixed seed, CPU, float32) prefills each
prompt once and saves its KV into a local stack: directory, and one worker with DRAM, NVMe (a
directory on local disk) and S3 (a local moto_server) tiers. A request is the cached prompt
plus `--new-tokens` tokens (the next turn). For each tier the cached blocks are first moved
there (`evict` DRAM, then NVMe), then per repeat a fresh client looks the request up, loads
the cached prefix (a prefix on NVMe or S3 is staged into DRAM inside prepare_load), and the
model computes the new tokens over it and picks the first token. "prefill" is the same
request computed from nothing. Every cached run's first token and logits are checked against
the prefill's.

Where the time goes, per cached run: lookup (POST /v1/lookup), prepare (prepare_load, which
includes the staging from NVMe/S3), transfer (NIXL reads to this process), checksum, complete
(complete_load), unpack (blocks -> per-layer tensors) and compute (the forward of the new
tokens). Medians over --repeats; JSON + a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, local_stack, machine, print_table, write_json  # noqa: E402

from kvstore.connector import KVStoreClient, Namespace  # noqa: E402
from kvstore.connector.hf import from_dynamic_cache, to_dynamic_cache  # noqa: E402
from kvstore.core import specs  # noqa: E402
from kvstore.core.keys import block_hashes  # noqa: E402
from kvstore.core.sizes import format_size  # noqa: E402
from tests.helpers import MotoServer  # noqa: E402

BLOCK_TOKENS = 256
VOCAB = 2048
PHASES = ("lookup", "prepare", "transfer", "checksum", "complete", "unpack", "compute")


def build_model(layers: int, max_tokens: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max_tokens, torch_dtype="float32")
    return LlamaForCausalLM(config).eval()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def prefill(model, request: list[int]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    logits = model(torch.tensor([request])).logits[0, -1]
    return time.perf_counter() - t0, logits


@torch.no_grad()
def cached_ttft(url: str, ns: Namespace, model, request: list[int], staging: int) -> tuple[dict, torch.Tensor, int]:
    """One request served from the store: seconds per phase (and 'total'), last logits, tokens loaded."""
    with KVStoreClient(url, ns, staging_bytes=staging) as client:
        t0 = time.perf_counter()
        client.lookup(request)
        lookup_s = time.perf_counter() - t0
        kv, n = client.load(request)
        load_s = time.perf_counter() - t0 - lookup_s
        timings = dict(client.last_timings)
        t1 = time.perf_counter()
        logits = model(torch.tensor([request[n:]]), past_key_values=to_dynamic_cache(kv, model.config),
                       use_cache=True).logits[0, -1]
        compute_s = time.perf_counter() - t1
    phases = {"lookup": lookup_s, "compute": compute_s, "unpack": load_s - timings.get("wall", 0.0)}
    phases.update({k: timings.get(k, 0.0) for k in ("prepare", "transfer", "checksum", "complete")})
    phases["total"] = lookup_s + load_s + compute_s
    return phases, logits, n


def move_to(url: str, ns: Namespace, tier: str, hashes: list[str]) -> None:
    """Leave the namespace's blocks only on `tier` (dram, nvme or s3)."""
    from kvstore.client import DirectoryClient

    directory = DirectoryClient(url)
    for upper in {"dram": (), "nvme": ("dram",), "s3": ("dram", "nvme")}[tier]:
        directory.evict_tier(specs.EvictRequest(tier=upper, namespace_id=ns.namespace_id, limit=100_000))
    by_tier = directory.lookup(ns.namespace_id, hashes).by_tier
    if by_tier != {tier: len(hashes)}:
        raise RuntimeError(f"expected every block on {tier}, the directory says {by_tier}")


def run_prompt(url: str, model, ns: Namespace, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    prompt = tokens(prompt_tokens, seed=prompt_tokens)
    request = prompt + tokens(new_tokens, seed=prompt_tokens + 1)
    staging = (prompt_tokens // BLOCK_TOKENS + 1) * ns.block_nbytes
    with torch.no_grad(), KVStoreClient(url, ns, staging_bytes=staging) as writer:
        out = model(torch.tensor([prompt]), use_cache=True)
        saved = writer.save(prompt, from_dynamic_cache(out.past_key_values))
    assert saved == prompt_tokens, f"saved {saved} of {prompt_tokens} tokens"
    hashes = [h.hex() for h in block_hashes(ns, prompt)]
    prefill_s, reference = [], None
    for _ in range(repeats):
        seconds, reference = prefill(model, request)
        prefill_s.append(seconds)
    first_token = int(reference.argmax())
    row = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "kv_bytes": len(hashes) * ns.block_nbytes,
           "prefill_s": statistics.median(prefill_s), "tiers": {}}
    for tier in ("dram", "nvme", "s3"):
        runs, worst = [], 0.0
        for _ in range(repeats):
            move_to(url, ns, tier, hashes)
            phases, logits, loaded = cached_ttft(url, ns, model, request, staging)
            assert loaded == prompt_tokens, f"{tier}: loaded {loaded} of {prompt_tokens} tokens"
            assert int(logits.argmax()) == first_token, f"{tier}: a different first token than the prefill's"
            worst = max(worst, float((logits - reference).abs().max()))
            runs.append(phases)
        median = {k: statistics.median(r[k] for r in runs) for k in (*PHASES, "total")}
        row["tiers"][tier] = {**median, "speedup": row["prefill_s"] / median["total"], "max_abs_logit_diff": worst}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="1024,4096,16384", help="cached prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens of the request after the cached prompt")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench/out/ttft.json")
    args = parser.parse_args()
    try:
        prompts = [int(p) for p in args.prompts.split(",")]
    except ValueError:
        sys.exit("error: --prompts takes comma-separated token counts")
    if any(p <= 0 or p % BLOCK_TOKENS for p in prompts) or args.new_tokens < 1 or args.layers < 1 or args.repeats < 1:
        sys.exit(f"error: prompts must be positive multiples of {BLOCK_TOKENS} tokens; --new-tokens, --layers "
                 "and --repeats positive")
    model = build_model(args.layers, max(prompts) + args.new_tokens)
    c = model.config
    ns = Namespace(model_id=f"bench-ttft-{args.layers}", num_layers=c.num_hidden_layers,
                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype="float32",
                   block_tokens=BLOCK_TOKENS)
    kv_bytes = max(prompts) // BLOCK_TOKENS * ns.block_nbytes
    tier_bytes = format_size(2 * kv_bytes + (64 << 20)).replace(" ", "")
    for key, value in MotoServer.CREDENTIALS.items():
        os.environ[key] = value
    results = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=REPO / "var" if (REPO / "var").is_dir()
                                     else None) as tmp:
        s3 = MotoServer(Path(tmp) / "moto.log").start()
        s3.client().create_bucket(Bucket="bench")
        worker_args = ("--nvme-bytes", tier_bytes, "--nvme-dir", str(Path(tmp) / "nvme"), "--s3-bucket", "bench",
                       "--s3-endpoint", s3.url, "--bounce-bytes", "64MiB")
        try:
            with local_stack(dram_bytes=tier_bytes, page_bytes=str(ns.block_nbytes), worker_args=worker_args) as url:
                for prompt_tokens in prompts:
                    print(f"prompt {prompt_tokens} tokens ...", flush=True)
                    results.append(run_prompt(url, model, ns, prompt_tokens, args.new_tokens, args.repeats))
        finally:
            s3.stop()
    print()
    print_table(["prompt", "KV", "prefill ms", *(f"{t} ms" for t in ("DRAM", "NVMe", "S3")),
                 *(f"{t} speedup" for t in ("DRAM", "NVMe", "S3"))],
                [[r["prompt_tokens"], format_size(r["kv_bytes"]), r["prefill_s"] * 1e3,
                  *(r["tiers"][t]["total"] * 1e3 for t in ("dram", "nvme", "s3")),
                  *(r["tiers"][t]["speedup"] for t in ("dram", "nvme", "s3"))] for r in results])
    print()
    print_table(["prompt", "tier", *(f"{p} ms" for p in PHASES)],
                [[r["prompt_tokens"], t, *(r["tiers"][t][p] * 1e3 for p in PHASES)]
                 for r in results for t in ("dram", "nvme", "s3")])
    write_json(args.json, {"benchmark": "ttft", "machine": machine(), "layers": args.layers,
                           "block_tokens": BLOCK_TOKENS, "repeats": args.repeats, "results": results})
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
