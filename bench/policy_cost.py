"""What an eviction policy (and its admission) costs per request, and per block it tracks, when it
tracks many blocks.

    python bench/policy_cost.py [--blocks 1000000] [--requests 20000] [--policies default,lru,...] [--json OUT]

Each policy is filled with `--blocks` blocks (chains of 16, as saves insert them: deepest first,
every save's last block a tail, a third of the saves with hints), then replays `--requests`
requests as bench/hit_ratio.py does (a lookup, hits touched, misses admitted and inserted, room
made by eviction): half of them read a random earlier chain's first 8 blocks and add 8 new ones,
half are new 16-block chains. µs/request is the policy's calls only; bytes per block is what
tracemalloc counts for the filled policy (and admission) over the number of blocks it holds.
JSON + a table.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_table, write_json  # noqa: E402
from hit_ratio import DEFAULT  # noqa: E402

from kvstore.policies import Admit, make_admission, make_eviction  # noqa: E402
from kvstore.policies.hints import NONE, Hints  # noqa: E402

CHAIN = 16
HINTS = (NONE, Hints(session="s", retain="turn"), Hints(session="s", retain="none"))


def build(label: str, capacity: int):
    name, *admission = (DEFAULT if label == "default" else label).split("+")
    return make_eviction(name, capacity), make_admission(",".join(admission), capacity) if admission else None


def save(policy, admission, chain: list[int], start: int, hints: Hints, capacity: int, protected: set) -> None:
    new = []
    for i in range(start, len(chain)):
        block = hints.as_tail(i == len(chain) - 1)
        if admission is not None and not isinstance(admission.admit(chain[i], 0, block), Admit):
            break
        new.append((chain[i], chain[i - 1] if i else None, block))
    while new and len(policy) + len(new) > capacity and policy.evict(1, protected) is not None:
        pass
    for key, parent, block in reversed(new):
        if key not in policy:
            policy.insert(key, parent, block)


def run(label: str, blocks: int, requests: int, rng: random.Random) -> dict:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    policy, admission = build(label, blocks)
    chains, next_key = [], 0
    while next_key < blocks:  # fill: a save per chain, no admission (the cost is what it holds)
        chain = list(range(next_key, next_key + CHAIN))
        next_key += CHAIN
        chains.append(chain)
        save(policy, None, chain, 0, HINTS[len(chains) % 3], blocks, set(chain))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    spent = 0.0
    for _ in range(requests):
        if rng.random() < 0.5:
            chain = rng.choice(chains)[:8] + list(range(next_key, next_key + 8))
        else:
            chain = list(range(next_key, next_key + CHAIN))
        next_key += CHAIN
        hints = HINTS[rng.randrange(3)]
        protected = set(chain)
        t0 = time.perf_counter()
        hit = 0
        while hit < len(chain) and chain[hit] in policy:
            hit += 1
        for key in reversed(chain[:hit]):
            policy.touch(key)
            if admission is not None:
                admission.record(key)
        save(policy, admission, chain, hit, hints, blocks, protected)
        spent += time.perf_counter() - t0
    return {"policy": label, "blocks": len(policy), "us_per_request": spent / requests * 1e6,
            "bytes_per_block": held / max(1, len(policy))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--policies", default="default,lru,lru+adaptive,arc,s3fifo")
    parser.add_argument("--json", default="bench/out/policy_cost.json")
    args = parser.parse_args()
    if args.blocks < CHAIN or args.requests < 1:
        sys.exit(f"error: --blocks must be at least {CHAIN} and --requests positive")
    results = []
    for label in args.policies.split(","):
        results.append(run(label, args.blocks, args.requests, random.Random(1)))
        print(f"{label}: {results[-1]['us_per_request']:.1f} µs/request", flush=True)
    print()
    print_table(["policy", "blocks held", "µs/request", "bytes/block"],
                [[r["policy"], r["blocks"], r["us_per_request"], round(r["bytes_per_block"])] for r in results])
    write_json(args.json, {"benchmark": "policy_cost", "machine": machine(), "chain_blocks": CHAIN,
                           "requests": args.requests, "results": results})


if __name__ == "__main__":
    main()
