"""The reference engine with faults put in on purpose, for tests/fault.

    python -m tests.fault.engine save --url URL --out R.json --markers DIR [--pause-at-complete K]
    python -m tests.fault.engine load --url URL --out R.json --markers DIR [--pause-at-complete 1]
                                      [--slow-s S] [--no-renew]

--staging-blocks makes `save` store its prompt in chunks (one reservation each). With
--pause-at-complete K the K-th complete_* call first writes DIR/paused and then waits until
DIR/resume exists (the test kills the process, or a worker, meanwhile), renewing what that call
completes unless --no-renew. --slow-s sleeps inside
each transfer, after the bytes moved, to outlast a lease. Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvstore.connector import KVStoreClient
from kvstore.connector.hf import from_dynamic_cache, to_dynamic_cache
from kvstore.connector.renewal import Renewal
from tests.integration.engine import CONTINUATION_TOKENS, PROMPT_TOKENS, build_model, namespace_of, tokens


def pause_at(fn, k: int, markers: Path, ttl_s: float):
    """`fn` (a complete_* call) waits at its k-th call until DIR/resume exists. Meanwhile it renews
    the call's token every `ttl_s`/3 (0: never), as a live engine's transfer does, so that only a
    kill, a worker's death or --no-renew lets what it holds expire."""
    calls = 0

    def wrapped(body, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == k:
            (markers / "paused").write_text(str(os.getpid()))
            with Renewal(fn.__self__, body.token if ttl_s else None, ttl_s):
                while not (markers / "resume").exists():
                    time.sleep(0.05)
        return fn(body, *args, **kwargs)
    return wrapped


def slowed(fn, seconds: float):
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        time.sleep(seconds)
        return result
    return wrapped


def client_for(args, model) -> KVStoreClient:
    ns = namespace_of(model)
    client = KVStoreClient(args.url, ns, staging_bytes=args.staging_blocks * ns.block_nbytes,
                           renew_leases=not args.no_renew)
    if args.pause_at_complete:
        name = "complete_store" if args.mode == "save" else "complete_load"
        setattr(client.directory, name, pause_at(getattr(client.directory, name), args.pause_at_complete,
                                                 Path(args.markers), 0 if args.no_renew else 1.5))
    if args.slow_s:  # every transfer, over NIXL or copied into a same-host arena
        client._move = slowed(client._move, args.slow_s)
        client.copier.copy_local = slowed(client.copier.copy_local, args.slow_s)
        client.copier.in_place = slowed(client.copier.in_place, args.slow_s)
    return client


@torch.no_grad()
def run(args) -> dict:
    model = build_model()
    prompt = tokens(PROMPT_TOKENS, seed=args.prompt_seed)
    if args.mode == "save":
        out = model(torch.tensor([prompt]), use_cache=True)
        with client_for(args, model) as client:
            return {"stored_tokens": client.save(prompt, from_dynamic_cache(out.past_key_values))}
    full = prompt + tokens(CONTINUATION_TOKENS, seed=10_000 + args.prompt_seed)
    with client_for(args, model) as client:
        kv, n = client.load(full)
        cached = model(torch.tensor([full[n:]]), past_key_values=to_dynamic_cache(kv, model.config),
                       use_cache=True).logits[0, -1] if n else None
    reference = model(torch.tensor([full])).logits[0, -1]
    # nothing loaded compares nothing: None, so that no test can read it as "exact"
    return {"loaded_tokens": n, "max_abs_diff": float((cached - reference).abs().max()) if n else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--markers", required=True)
    parser.add_argument("--prompt-seed", type=int, default=1)
    parser.add_argument("--staging-blocks", type=int, default=1024)
    parser.add_argument("--pause-at-complete", type=int, default=0)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--no-renew", action="store_true")
    args = parser.parse_args()
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
