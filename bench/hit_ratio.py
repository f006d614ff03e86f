"""Prefix and block hit ratios of the eviction policies on a trace, with LRU and Belady's OPT.

    python bench/hit_ratio.py --trace PATH --capacities 0.02,0.05,0.1 --json OUT [--policies lru,s3fifo,...]
                              [--hints [--random-hints]]
    python bench/hit_ratio.py --trace PATH --tiers dram=0.02,nvme=0.1,s3=0.5 [--gbps dram=4.5,nvme=1.2,s3=0.4]
                              [--block-bytes 64MiB] --json OUT [--policies ...] [--hints]   # multi-tier mode

A policy is an eviction policy name, optionally with admission conditions: `lru+doorkeeper`,
`arc+size:0-1MiB+tinylfu`. `default` is what the directory runs out of the box.

Trace: one JSON object per line with `hash_ids` (block ids of a request, in order), and
optionally `session_id` (string), `turn` (int), `retain` ("turn", "session" or "none") and
`priority` (int): what an engine may say about the request. Each request first looks its blocks
up (prefix hits count up to its first miss), then saves them all, as an engine does after
prefill: hits are touched, admitted misses inserted (evicting to make room; the request's own
blocks are protected), both deepest block first as the directory does. Every save's last block
is marked a tail, as the directory marks it. With `--hints` every policy also runs with the
trace's hints given to it (rows `"hints": true`, beside the `false` ones); `--random-hints` adds
a run with the trace's hints shuffled across its requests (`"random": true`). Capacity = a
fraction of the distinct blocks. OPT evicts the block whose next use is farthest and never
caches a block that is not used again. The policy's own cost per request (µs) is measured
around its calls.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiered  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402

from kvstore.core.errors import KVStoreError  # noqa: E402
from kvstore.core.sizes import parse_size  # noqa: E402
from kvstore.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION, EVICTION, Admit, make_admission  # noqa: E402
from kvstore.policies import make_eviction  # noqa: E402
from kvstore.policies.admission import Always  # noqa: E402
from kvstore.policies.hints import NONE, RETAIN, Hints  # noqa: E402

DEFAULT = f"{DEFAULT_EVICTION}+{DEFAULT_ADMISSION}"


def load_trace(path: str) -> tuple[list[list[int]], list[Hints | None]]:
    """The requests' block ids, and per request the hints its line carries (None: none)."""
    requests, hints = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            requests.append(row["hash_ids"])
            hints.append(_hints(row, n))
    return requests, hints


def _hints(row: dict, line: int) -> Hints | None:
    if not any(k in row for k in ("session_id", "retain", "priority")):
        return None
    retain = row.get("retain")
    if retain is not None and retain not in RETAIN:
        raise ValueError(f"line {line}: retain {retain!r} is not one of {', '.join(RETAIN)}")
    return Hints(session=row.get("session_id"), retain=retain, priority=int(row.get("priority", 0)))


def shuffled(hints: list[Hints | None], seed: int = 7) -> list[Hints | None]:
    """The same hints, each given to another request (a policy must not be fooled by them)."""
    out = list(hints)
    random.Random(seed).shuffle(out)
    return out


def lookup(requests_cached, request) -> tuple[int, int]:
    """(prefix hits, block hits) of one request against a membership test."""
    prefix, blocks, broken = 0, 0, False
    for key in request:
        if requests_cached(key):
            blocks += 1
            prefix += not broken
        else:
            broken = True
    return prefix, blocks


def simulate(policy, requests: list[list[int]], capacity: int, admission=None,
             hints: list[Hints | None] | None = None) -> dict:
    """What the directory does per request: hits touched deepest first (a prefix stays more recent
    than its suffixes), then admitted misses stored, room made by eviction, inserted deepest first;
    each block with its request's hints (`hints`, if given) and the tail mark of the save's last."""
    admission = admission or Always()
    prefix = blocks = total = 0
    spent = 0.0
    for number, request in enumerate(requests):
        said = (hints[number] if hints is not None else None) or NONE
        p, b = lookup(policy.__contains__, request)
        prefix, blocks, total = prefix + p, blocks + b, total + len(request)
        t0 = time.perf_counter()
        for key in reversed(request):
            if key in policy:
                policy.touch(key)
                admission.record(key)
        new = []
        last = len(request) - 1
        for i, key in enumerate(request):
            if key in policy:
                continue
            if not isinstance(admission.admit(key, 0, said.as_tail(i == last)), Admit):
                for j, rest in enumerate(request[i + 1:], i + 1):  # a suffix without its prefix is useless
                    if rest not in policy:  # but it was seen
                        admission.admit(rest, 0, said.as_tail(j == last))
                break
            new.append((key, request[i - 1] if i else None, said.as_tail(i == last)))
        protected = set(request)
        while new and len(policy) + len(new) > capacity and policy.evict(1, protected) is not None:
            pass
        del new[max(0, capacity - len(policy)):]  # no room even after eviction: the tail is not cached
        for key, parent, block_hints in reversed(new):
            policy.insert(key, parent, block_hints)
        spent += time.perf_counter() - t0
    return {"prefix_hit_ratio": prefix / total, "block_hit_ratio": blocks / total,
            "policy_us_per_request": spent / len(requests) * 1e6}


def simulate_opt(requests: list[list[int]], capacity: int) -> dict:
    flat = [key for request in requests for key in request]
    next_use = [0] * len(flat)
    last: dict = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last.get(flat[i], float("inf"))
        last[flat[i]] = i
    cached: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key), stale entries skipped
    prefix = blocks = total = 0
    position = 0
    for request in requests:
        p, b = lookup(cached.__contains__, request)
        prefix, blocks, total = prefix + p, blocks + b, total + len(request)
        for key in request:
            nu = next_use[position]
            position += 1
            if key in cached or len(cached) < capacity:
                if nu == float("inf"):
                    cached.pop(key, None)  # never used again: not worth a slot
                    continue
                cached[key] = nu
                heapq.heappush(heap, (-nu, key))
                continue
            if nu == float("inf"):
                continue
            while True:  # the farthest next use among the cached keys
                far, victim = heapq.heappop(heap)
                if cached.get(victim) == -far:
                    break
            if -far > nu:
                del cached[victim]
                cached[key] = nu
                heapq.heappush(heap, (-nu, key))
            else:
                heapq.heappush(heap, (far, victim))  # the newcomer is used last: bypass it
    return {"prefix_hit_ratio": prefix / total, "block_hit_ratio": blocks / total, "policy_us_per_request": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--capacities", default="0.02,0.05,0.1")
    parser.add_argument("--policies", default="default," + ",".join(sorted(EVICTION)))
    parser.add_argument("--json", default="bench/out/hit_ratio.json")
    parser.add_argument("--tiers", help="multi-tier mode: capacity fraction per tier, e.g. dram=0.02,nvme=0.1,s3=0.5")
    parser.add_argument("--gbps", default="dram=4.5,nvme=1.2,s3=0.4",
                        help="read GB/s per tier (defaults: store load / promote rates in docs/benchmarks.md)")
    parser.add_argument("--block-bytes", default="64MiB", help="KV bytes of one block (Llama-3-8B, 512 tokens, bf16)")
    parser.add_argument("--prefill-ms", type=float, default=30.0,
                        help="recomputing one missed block (assumed: 512 tokens of an 8B model on one H100)")
    parser.add_argument("--hints", action="store_true", help="also run every policy with the trace's hints")
    parser.add_argument("--random-hints", action="store_true", help="and with them shuffled across requests")
    args = parser.parse_args()
    try:
        requests, hints = load_trace(args.trace)
        capacities = [float(c) for c in args.capacities.split(",")]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        sys.exit(f"error: cannot read the trace or capacities: {exc}")
    if args.random_hints and not args.hints:
        sys.exit("error: --random-hints needs --hints")
    # (hints given, shuffled?, the hints): the runs of every policy
    runs = [(False, False, None)] + ([(True, False, hints)] if args.hints else []) + \
        ([(True, True, shuffled(hints))] if args.random_hints else [])
    labels = args.policies.split(",")
    try:
        for label in labels:  # fail before hours of simulation, not after
            name, *admission = (DEFAULT if label == "default" else label).split("+")
            make_eviction(name, 1)
            if admission:
                make_admission(",".join(admission), 1)
    except KVStoreError as exc:
        sys.exit(f"error: policy {label!r}: {exc}")
    distinct = len({key for request in requests for key in request})
    if args.tiers:
        return tiers_mode(args, requests, labels, distinct, runs)
    results = []
    for fraction in capacities:
        capacity = max(1, int(fraction * distinct))
        for label in labels:
            name, *admission = (DEFAULT if label == "default" else label).split("+")
            for hinted, random_hints, given in runs:
                row = simulate(make_eviction(name, capacity), requests, capacity,
                               make_admission(",".join(admission), capacity) if admission else None, given)
                results.append({"capacity_fraction": fraction, "policy": label, "hints": hinted,
                                **({"random": True} if random_hints else {}), **row})
                print(f"capacity {fraction:.2f} {label:>10}{_run(hinted, random_hints)}: prefix hit "
                      f"{row['prefix_hit_ratio']:.3f}", flush=True)
        results.append({"capacity_fraction": fraction, "policy": "opt", "hints": False,
                        **simulate_opt(requests, capacity)})
    print()
    print_table(["capacity", "policy", "hints", "prefix hit", "block hit", "µs/request"],
                [[f'{r["capacity_fraction"]:.2f}', r["policy"], _run(r["hints"], r.get("random", False)).strip(),
                  f'{r["prefix_hit_ratio"]:.3f}', f'{r["block_hit_ratio"]:.3f}', f'{r["policy_us_per_request"]:.1f}']
                 for r in results])
    write_json(args.json, {"benchmark": "hit_ratio", "machine": machine(), "trace": os.path.basename(args.trace),
                           "requests": len(requests), "distinct_blocks": distinct,
                           "hinted_requests": sum(h is not None for h in hints), "results": results})


def _run(hinted: bool, random_hints: bool) -> str:
    return " random hints" if random_hints else " hints" if hinted else " no hints"


def tiers_mode(args, requests: list[list[int]], labels: list[str], distinct: int, runs: list) -> None:
    try:
        fractions = {k: float(v) for k, v in (part.split("=") for part in args.tiers.split(","))}
        gbps = {k: float(v) for k, v in (part.split("=") for part in args.gbps.split(","))}
        block_bytes = parse_size(args.block_bytes)
        capacities = [max(1, int(fractions[t] * distinct)) for t in tiered.TIERS]
        cost_ms = tiered.costs(block_bytes, gbps)
    except (ValueError, KeyError, KVStoreError) as exc:
        sys.exit(f"error: --tiers/--gbps need dram=,nvme=,s3= numbers and --block-bytes a size: {exc}")
    results = []
    for label in dict.fromkeys(labels + ["lru"]):  # LRU everywhere, without hints, is the baseline
        name, *admission = (DEFAULT if label == "default" else label).split("+")
        for hinted, random_hints, given in runs if label != "lru" else runs[:1]:
            hierarchy = tiered.build(lambda c: make_eviction(name, c),
                                     (lambda c: make_admission(",".join(admission), c)) if admission else None,
                                     capacities)
            row = tiered.simulate_tiers(hierarchy, requests, cost_ms, args.prefill_ms, given)
            results.append({"policy": label, "hints": hinted, **({"random": True} if random_hints else {}),
                            "tiers": fractions, **row})
            print(f"{label:>14}{_run(hinted, random_hints)}: prefix hit {row['prefix_hit_ratio']:.3f}, "
                  f"KV {row['kv_ms_per_request']:.0f} ms/request", flush=True)
    lru = next(r for r in results if r["policy"] == "lru")
    for r in results:
        r["kv_time_vs_lru"] = r["kv_ms_per_request"] / lru["kv_ms_per_request"]
        r["kv_ms_saved_vs_lru"] = lru["kv_ms_per_request"] - r["kv_ms_per_request"]
    print()
    print_table(["policy", "hints", "prefix hit", "from DRAM", "from NVMe", "from S3", "load ms/req",
                 "load+prefill ms/req", "vs LRU", "saved ms/req"],
                [[r["policy"], _run(r["hints"], r.get("random", False)).strip(), f'{r["prefix_hit_ratio"]:.3f}',
                  *(f'{r["served"][t]:.3f}' for t in tiered.TIERS), f'{r["load_ms_per_request"]:.0f}',
                  f'{r["kv_ms_per_request"]:.0f}', f'{r["kv_time_vs_lru"]:.3f}', f'{r["kv_ms_saved_vs_lru"]:.1f}']
                 for r in results])
    write_json(args.json, {"benchmark": "hit_ratio_tiers", "machine": machine(), "trace": os.path.basename(args.trace),
                           "requests": len(requests), "distinct_blocks": distinct, "gbps": gbps,
                           "block_bytes": block_bytes, "prefill_ms_per_block": args.prefill_ms, "cost_ms_per_block": dict(zip(tiered.TIERS, cost_ms)),
                           "results": results})


if __name__ == "__main__":
    main()
