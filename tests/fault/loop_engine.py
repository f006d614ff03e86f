"""An engine that saves and loads prompts in a loop until told to stop (the replica fault tests).

    python -m tests.fault.loop_engine --url URL1,URL2,... --out R.json --markers DIR [--seed S] [--rounds N]

Prompt k is BLOCKS blocks whose bytes follow from (seed, k) alone, so every load is checked byte
for byte. Each round loads every prompt and saves again whatever missed. The engine writes
DIR/ready after its first round and stops when DIR/stop appears (or after --rounds); --out then gets every call's
outcome with its time: a load is `exact` (all blocks, right bytes), `partial` (a verified prefix,
right bytes), `miss`, or `wrong` (bytes that differ: must never happen); a call that raised is
recorded with its exception (must never happen either: the store is a cache).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import numpy as np

from kvstore.connector import KVStoreClient
from kvstore.core.keys import Namespace, block_hashes

PROMPTS, BLOCKS = 12, 4
NAMESPACE = Namespace(model_id="replica-faults", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                      block_tokens=16)


def prompt(seed: int, k: int, memory: np.ndarray) -> tuple[list[bytes], list[np.ndarray]]:
    """Prompt k's hashes and its blocks, written into `memory` (BLOCKS blocks)."""
    rng = np.random.default_rng([seed, k])
    tokens = rng.integers(0, 30_000, BLOCKS * NAMESPACE.block_tokens)
    memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
    return block_hashes(NAMESPACE, tokens), np.split(memory, BLOCKS)



def chains(seed: int) -> list[list[str]]:
    """The hashes of the engine's prompts for `seed`, hex, as lookups take them."""
    scratch = np.zeros(BLOCKS * NAMESPACE.block_nbytes, np.uint8)
    return [[h.hex() for h in prompt(seed, k, scratch)[0]] for k in range(PROMPTS)]

def run(args) -> dict:
    markers = Path(args.markers)
    memory = np.zeros((PROMPTS + 1) * BLOCKS * NAMESPACE.block_nbytes, dtype=np.uint8)  # the last: loads
    chunks = np.split(memory, PROMPTS + 1)
    prompts = [prompt(args.seed, k, chunks[k]) for k in range(PROMPTS)]
    out = np.split(chunks[-1], BLOCKS)
    events: list[list] = []
    errors: list[str] = []
    t0 = time.time()
    with KVStoreClient(args.url, NAMESPACE, staging_bytes=BLOCKS * NAMESPACE.block_nbytes) as client:
        client.register_buffer(memory)
        rounds = 0
        while not (markers / "stop").exists() and (not args.rounds or rounds < args.rounds):
            for hashes, blocks in prompts:
                chunks[-1][:] = 0
                try:
                    n = client.load_blocks(hashes, out)
                    right = all(np.array_equal(a, b) for a, b in zip(out[:n], blocks[:n]))
                    outcome = "wrong" if not right else "exact" if n == BLOCKS else "partial" if n else "miss"
                    events.append([time.time() - t0, "load", outcome, n])
                    if outcome == "exact":
                        (markers / "last_exact.tmp").write_text(repr(time.time()))
                        os.replace(markers / "last_exact.tmp", markers / "last_exact")  # read whole or not at all
                    if n < BLOCKS:
                        held = client.save_blocks(hashes, blocks)
                        events.append([time.time() - t0, "save", "ok" if held == BLOCKS else "short", held])
                except Exception:  # noqa: BLE001 (what the test must never see, recorded for it)
                    errors.append(traceback.format_exc())
                    events.append([time.time() - t0, "error", "raised", 0])
                time.sleep(0.01)
            rounds += 1
            if rounds == 1:
                (markers / "ready").write_text("1")
    return {"events": events, "errors": errors, "rounds": rounds, "started_at": t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--markers", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: at DIR/stop)")
    args = p.parse_args()
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
