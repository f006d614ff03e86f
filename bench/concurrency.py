"""Many engines saving and loading at once, through one directory and one worker.

    python bench/concurrency.py [--engines 1,4,16] [--seconds 10] [--block-bytes 64KiB] [--json OUT]

Directory and worker run as their own processes (as in bench/datapath.py); each
engine is a process with its own KVStoreClient (NIXL agent, registered buffers).
Every engine repeats, for --seconds: save a chain of its own, save one of a few
chains all engines share, load its own chain back, load a shared chain. A
block's bytes are a function of its hash, so every load is checked byte for
byte whoever saved it. Reported per engine count: saved and loaded blocks per
second (all engines together), loads that found fewer blocks than were saved
(evicted or still being written by another engine: a cache, not an error), and
errors (an exception, or a byte that differs: there must be none).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, print_table, write_json  # noqa: E402

from kvstore.core.sizes import format_size, parse_size  # noqa: E402

CHAIN = 16  # blocks per prefix
SHARED = 8  # prefixes every engine saves and loads


def namespace(block_bytes: int):
    from kvstore.connector import Namespace
    per_token = 2 * 8 * 128 * 2  # one layer, K+V, 8 heads, head_dim 128, bf16
    return Namespace(model_id=f"bench-concurrency-{block_bytes}", num_layers=1, num_kv_heads=8, head_dim=128,
                     dtype="bfloat16", block_tokens=block_bytes // per_token)


def block_hash(owner: int, chain: int, i: int) -> bytes:
    return owner.to_bytes(4, "little") + chain.to_bytes(8, "little") + i.to_bytes(4, "little")


def fill(view: np.ndarray, h: bytes) -> None:
    """The bytes of block `h`: its hash repeated."""
    view[:] = np.resize(np.frombuffer(h, dtype=np.uint8), view.shape)


def engine(url: str, k: int, seconds: float, block_bytes: int, start: mp.Event, ready: mp.Queue,
           out: mp.Queue) -> None:
    from kvstore.connector import KVStoreClient
    from kvstore.core.memory import HostBuffer

    src, dst = HostBuffer(CHAIN * block_bytes), HostBuffer(CHAIN * block_bytes)
    src_views = [src.view(i * block_bytes, block_bytes) for i in range(CHAIN)]
    dst_views = [dst.view(i * block_bytes, block_bytes) for i in range(CHAIN)]
    done = {"saved": 0, "loaded": 0, "short_loads": 0, "errors": 0, "calls": 0, "first_error": None}
    with KVStoreClient(url, namespace(block_bytes), staging_bytes=block_bytes) as client:
        client.register_buffer(src.array)
        client.register_buffer(dst.array)
        ready.put(k)
        start.wait()
        deadline, n = time.perf_counter() + seconds, 0
        while time.perf_counter() < deadline:
            for owner, chain in ((k + 1, n), (0, n % SHARED)):  # own chain, then a shared one (owner 0)
                hashes = [block_hash(owner, chain, i) for i in range(CHAIN)]
                try:
                    for view, h in zip(src_views, hashes):
                        fill(view, h)
                    saved = client.save_blocks(hashes, src_views)
                    done["saved"] += saved if owner else 0  # a shared chain is mostly there already
                    dst.array[:] = 0
                    loaded = client.load_blocks(hashes, dst_views)
                    done["loaded"] += loaded
                    done["short_loads"] += loaded < saved
                    for view, h in zip(dst_views[:loaded], hashes):
                        expected = np.empty_like(view)
                        fill(expected, h)
                        if not np.array_equal(view, expected):
                            raise AssertionError(f"block {h.hex()} loaded wrong bytes")
                except Exception as exc:  # noqa: BLE001 (counted and reported)
                    done["errors"] += 1
                    done["first_error"] = done["first_error"] or repr(exc)[:300]
                done["calls"] += 2
            n += 1
    out.put(done)


def run(url: str, engines: int, seconds: float, block_bytes: int) -> dict:
    ctx = mp.get_context("spawn")
    start, ready, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=engine, args=(url, k, seconds, block_bytes, start, ready, out))
             for k in range(engines)]
    for p in procs:
        p.start()
    for _ in range(engines):
        ready.get(timeout=300)
    start.set()
    results = [out.get(timeout=seconds + 300) for _ in range(engines)]
    for p in procs:
        p.join()
    total = {key: sum(r[key] for r in results) for key in ("saved", "loaded", "short_loads", "errors", "calls")}
    return {"engines": engines, **total, "saved_blocks_per_s": total["saved"] / seconds,
            "loaded_blocks_per_s": total["loaded"] / seconds,
            "gb_per_s": (total["saved"] + total["loaded"]) * block_bytes / seconds / 1e9,
            "first_error": next((r["first_error"] for r in results if r["first_error"]), None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--block-bytes", default="64KiB")
    parser.add_argument("--dram-bytes", default="1GiB", help="the worker's DRAM tier")
    parser.add_argument("--json")
    args = parser.parse_args()
    block_bytes = parse_size(args.block_bytes)
    counts = [int(n) for n in args.engines.split(",")]
    rows = []
    with local_stack(dram_bytes=args.dram_bytes, page_bytes=format_size(block_bytes).replace(" ", "")) as url:
        for n in counts:
            rows.append(run(url, n, args.seconds, block_bytes))
            print(f"{n} engines: {rows[-1]['saved_blocks_per_s']:,.0f} saved and {rows[-1]['loaded_blocks_per_s']:,.0f}"
                  f" loaded blocks/s, {rows[-1]['errors']} errors", flush=True)
    print()
    print_table(["engines", "saved blocks/s", "loaded blocks/s", "GB/s moved", "calls", "short loads", "errors"],
                [[r["engines"], round(r["saved_blocks_per_s"]), round(r["loaded_blocks_per_s"]), r["gb_per_s"],
                  r["calls"], r["short_loads"], r["errors"]] for r in rows])
    for r in rows:
        if r["first_error"]:
            print(f"{r['engines']} engines, first error: {r['first_error']}")
    write_json(args.json, {"machine": machine(), "block_bytes": block_bytes, "chain_blocks": CHAIN,
                           "shared_chains": SHARED, "seconds": args.seconds, "results": rows})


if __name__ == "__main__":
    main()
