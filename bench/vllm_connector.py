"""The vLLM connector's path: how long the forward waits inside the connector, and how much of a
save the asynchronous saves take off it.

    make setup-vllm
    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python bench/vllm_connector.py [--prompts 4] [--prompt-tokens 2048]
                                                                         [--repeats 3] [--json OUT]

Per repeat, on a fresh local stack (directory + worker processes): engine A (the contract engine
of tests_vllm/engine.py: vLLM 0.33's own Scheduler, KVStoreConnector's worker half, a stand-in
model writing the KV on the CPU) prefills the prompts in 256-token chunks and saves them; engine
B runs the same prompts and loads them. Reported, medians over repeats:

    A  hook ms / save step     time inside the worker half's hooks in a step that saves
    A  save ms                 mean of kvstore_connector_save_seconds (first layer handed over -> committed)
    sync hook ms / save step   the same engine A on another fresh stack, each step waiting for its saves
                               to commit (--wait-saves): what synchronous saves would cost the forward
    B  hook ms / load step     the same for the step that loads
    B  overlap                 1 - sum(T_visible) / sum(T_xfer) of the loads

The KV geometry is the contract engine's (4 layers, 2 KV heads of 8, float32: 2 KiB per token),
so the byte counts are small and the numbers are mostly control-plane latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine(url: str, tmp: str, name: str, *args: str) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    with open(os.path.join(tmp, f"{name}.log"), "ab") as log:
        proc = subprocess.run([sys.executable, "-m", "tests_vllm.engine", "--url", url, "--out", out, *args],
                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"engine {name} failed; see {tmp}/{name}.log")
    with open(out) as f:
        return json.load(f)


def one_run(args) -> dict:
    common = ("--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens), "--num-blocks",
              str(args.prompts * (args.prompt_tokens // 16 + 2) + 1), "--max-tokens", "1")
    chunked = ("--max-batched-tokens", "256")
    with local_stack(dram_bytes="512MiB", page_bytes="4KiB") as url, tempfile.TemporaryDirectory() as tmp:
        a = engine(url, tmp, "a", *common, *chunked)
        b = engine(url, tmp, "b", *common, "--max-batched-tokens", str(args.prompts * args.prompt_tokens))
    with local_stack(dram_bytes="512MiB", page_bytes="4KiB") as url, tempfile.TemporaryDirectory() as tmp:
        sync = engine(url, tmp, "sync", *common, *chunked, "--wait-saves")  # each step waits for its saves
    saves = [s["hook_s"] for s in a["step_log"] if s["saves"]]
    sync_saves = [s["hook_s"] for s in sync["step_log"] if s["saves"]]
    loads = [s["hook_s"] for s in b["step_log"] if s["loads"]]
    xfer, visible = b["histogram_sums"]["layer_xfer"], b["histogram_sums"]["layer_visible"]
    hit = sum(r["matched"][0] for r in b["requests"].values())
    return {"a_hook_ms_per_save_step": 1e3 * statistics.median(saves), "a_save_steps": len(saves),
            "sync_hook_ms_per_save_step": 1e3 * statistics.median(sync_saves),
            "sync_over_async": statistics.median(sync_saves) / statistics.median(saves),
            "a_save_ms": 1e3 * a["histogram_sums"]["save"] / max(1, a["histogram_counts"]["save"]),
            "b_hook_ms_per_load_step": 1e3 * statistics.median(loads) if loads else None,
            "b_sum_xfer_ms": 1e3 * xfer, "b_sum_visible_ms": 1e3 * visible,
            "b_overlap": 1 - visible / xfer if xfer else None, "b_hit_tokens": hit,
            "kv_exact": all(r["kv_exact"] for e in (a, b, sync) for r in e["requests"].values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(REPO, "bench", "out", "vllm_connector.json"))
    args = parser.parse_args()
    runs = [one_run(args) for _ in range(args.repeats)]
    keys = [k for k in runs[0] if k != "kv_exact"]
    summary = {k: statistics.median(r[k] for r in runs) for k in keys if runs[0][k] is not None}
    summary["kv_exact"] = all(r["kv_exact"] for r in runs)
    print_table(["metric", "median"], [[k, f"{v:.3f}" if isinstance(v, float) else v] for k, v in summary.items()])
    write_json(args.json, {"machine": machine(), "args": vars(args), "runs": runs, "median": summary})


if __name__ == "__main__":
    main()
