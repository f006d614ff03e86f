"""Store save/load throughput vs raw NIXL UCX and memcpy, side by side in one run.

    python bench/datapath.py [--sizes 64KiB,1MiB,32MiB] [--batch-bytes 64MiB] [--repeats 5]
                             [--same-host auto|off] [--json OUT]

With `--same-host auto` (the default, as engines run) the connector copies blocks straight into
and out of the worker's DRAM arena, which the worker shares with this process; `off` takes NIXL
UCX, the path between hosts.

The engine side (this process) keeps blocks in the store's layout in memory it
registered once, as a paged engine does, and saves/loads a batch of blocks per
call through KVStoreClient.save_blocks / load_blocks: directory prepare, xxh3
checksums, one NIXL request to the worker, directory complete. "raw NIXL" is
the same bytes, same descriptors, same two processes, as one NIXL request with
nothing else; "raw+xxh3" is that request with the store's checksum pass over the same bytes
running beside it (what the checksums cost on this machine). "memcpy" is one thread's np.copyto
of the batch. "verified save" is the same save against a second stack whose directory runs with
--verify-writes (the worker checksums every block before it is committed). Each figure is the
median over --repeats batches; ratios are of medians from the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, median, print_table, raw_xfer, timed, write_json  # noqa: E402

from kvstore.connector import KVStoreClient, Namespace  # noqa: E402
from kvstore.core.keys import checksum  # noqa: E402
from kvstore.core.memory import HostBuffer  # noqa: E402
from kvstore.core.sizes import format_size, parse_size  # noqa: E402


def namespace_for(block_bytes: int) -> Namespace:
    per_token = 8 * 2 * 8 * 128 * 2  # 8 layers, K+V, 8 heads, head_dim 128, bf16 = 32 KiB per token
    assert block_bytes % per_token == 0, f"block sizes must be multiples of {per_token} bytes"
    return Namespace(model_id=f"bench-{block_bytes}", num_layers=8, num_kv_heads=8, head_dim=128,
                     dtype="bfloat16", block_tokens=block_bytes // per_token)


def raw_nixl(client: KVStoreClient, op: str, views, locations) -> float:
    """One NIXL request over exactly the store's descriptors, posted and polled with nothing else."""
    agent = client.agent
    peer = client.peers.agent_for(locations[0].worker, locations[0].epoch)
    local, remote = [], []
    for view, location in zip(views, locations):
        addr = int(view.ctypes.data)
        for run_addr, run_len in location.runs:
            local.append((addr, run_len, 0))
            remote.append((run_addr, run_len, 0))
            addr += run_len
    return raw_xfer(agent, op, np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64), peer)


def bench_size(url: str, block_bytes: int, batch_bytes: int, repeats: int, same_host: str) -> dict:
    ns = namespace_for(block_bytes)
    n = max(1, batch_bytes // block_bytes)
    nbytes = n * block_bytes
    src, dst = HostBuffer(nbytes), HostBuffer(nbytes)
    src.array[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    samples: dict[str, list[float]] = {k: [] for k in (
        "store_save", "store_load", "raw_write", "raw_read", "raw_write_xxh3", "raw_read_xxh3", "memcpy",
        "save_control", "load_control")}
    phases: dict[str, list[dict]] = {"save": [], "load": []}
    with KVStoreClient(url, ns, staging_bytes=block_bytes, same_host=same_host) as client:
        client.register_buffer(src.array)
        client.register_buffer(dst.array)
        src_views = [src.view(i * block_bytes, block_bytes) for i in range(n)]
        dst_views = [dst.view(i * block_bytes, block_bytes) for i in range(n)]
        for rep in range(repeats + 1):  # the first round warms connections and pages up; not counted
            hashes = [os.urandom(16) for _ in range(n)]
            save_s = timed(lambda: _expect(client.save_blocks(hashes, src_views), n, "save"))
            save_t = dict(client.last_timings)
            dst.array[:] = 0
            load_s = timed(lambda: _expect(client.load_blocks(hashes, dst_views), n, "load"))
            load_t = dict(client.last_timings)
            assert np.array_equal(src.array, dst.array), "loaded bytes differ from saved bytes"
            locations = [b.location for b in client.directory.lookup(ns.namespace_id, [h.hex() for h in hashes],
                                                                          locations=True).blocks]
            raw_w = raw_nixl(client, "WRITE", src_views, locations)
            raw_r = raw_nixl(client, "READ", dst_views, locations)
            raw_wc = hashed(client, lambda: raw_nixl(client, "WRITE", src_views, locations), src_views)
            raw_rc = hashed(client, lambda: raw_nixl(client, "READ", dst_views, locations), dst_views)
            copy_s = timed(lambda: np.copyto(dst.array, src.array))
            client.directory.evict(ns.namespace_id)
            if rep == 0:
                continue
            for key, seconds in (("store_save", save_s), ("store_load", load_s), ("raw_write", raw_w),
                                 ("raw_read", raw_r), ("raw_write_xxh3", raw_wc), ("raw_read_xxh3", raw_rc),
                                 ("memcpy", copy_s)):
                samples[key].append(nbytes / seconds / 1e9)
            phases["save"].append(save_t)
            phases["load"].append(load_t)
            samples["save_control"].append((save_t["prepare"] + save_t["complete"]) / save_t["wall"])
            samples["load_control"].append((load_t["prepare"] + load_t["complete"]) / load_t["wall"])
    gbps = {k: median(v) for k, v in samples.items()}
    return {"block_bytes": block_bytes, "blocks_per_call": n, "bytes_per_call": nbytes,
            "gbps": {k: v for k, v in gbps.items() if not k.endswith("control")},
            "control_share": {"save": gbps["save_control"], "load": gbps["load_control"]},
            "phases_ms": {op: {k: median([t.get(k, 0.0) for t in runs]) * 1e3 for k in runs[0]}
                          for op, runs in phases.items()},
            "ratios": {"save_vs_raw": gbps["store_save"] / gbps["raw_write"],
                       "load_vs_raw": gbps["store_load"] / gbps["raw_read"],
                       "save_vs_raw_xxh3": gbps["store_save"] / gbps["raw_write_xxh3"],
                       "load_vs_raw_xxh3": gbps["store_load"] / gbps["raw_read_xxh3"],
                       "save_vs_memcpy": gbps["store_save"] / gbps["memcpy"],
                       "load_vs_memcpy": gbps["store_load"] / gbps["memcpy"]},
            "samples_gbps": samples}


def bench_verified_save(url: str, block_bytes: int, batch_bytes: int, repeats: int, same_host: str) -> float:
    """Median GB/s of saves into a directory that has the worker checksum every block before commit."""
    ns = namespace_for(block_bytes)
    n = max(1, batch_bytes // block_bytes)
    src = HostBuffer(n * block_bytes)
    src.array[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    samples = []
    with KVStoreClient(url, ns, staging_bytes=block_bytes, same_host=same_host) as client:
        client.register_buffer(src.array)
        views = [src.view(i * block_bytes, block_bytes) for i in range(n)]
        for rep in range(repeats + 1):
            hashes = [os.urandom(16) for _ in range(n)]
            seconds = timed(lambda: _expect(client.save_blocks(hashes, views), n, "verified save"))
            client.directory.evict(ns.namespace_id)
            if rep:
                samples.append(src.nbytes / seconds / 1e9)
    return median(samples)


def hashed(client: KVStoreClient, transfer, views) -> float:
    """Seconds for `transfer` with the store's checksum pass over the same bytes running beside it on
    the client's hashing thread, as a save and a load do: what the checksums cost on this machine."""
    t0 = time.perf_counter()
    sums = client._hasher.submit(lambda: [checksum(v) for v in views])  # the bench reaches under the client
    transfer()
    sums.result()
    return time.perf_counter() - t0


def _expect(got: int, want: int, what: str) -> None:
    assert got == want, f"{what} moved {got} of {want} blocks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64KiB,256KiB,1MiB,4MiB,16MiB,32MiB")
    parser.add_argument("--batch-bytes", default="256MiB", help="bytes per save/load call (a long prompt of a large model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--same-host", choices=("auto", "off"), default="auto",
                        help="auto: copies into the worker's shared arena; off: NIXL UCX (the cross-host path)")
    parser.add_argument("--json", default="bench/out/datapath.json")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch = parse_size(args.batch_bytes)
    results = []
    dram = format_size(2 * max(batch, max(sizes)) + (64 << 20)).replace(" ", "")
    with local_stack(dram_bytes=dram) as url:
        for size in sizes:
            print(f"block {format_size(size)} ...", flush=True)
            results.append(bench_size(url, size, batch, args.repeats, args.same_host))
    with local_stack(dram_bytes=dram, directory_args=("--verify-writes",)) as url:
        for r in results:
            print(f"block {format_size(r['block_bytes'])}, writes verified ...", flush=True)
            r["gbps"]["store_save_verified"] = bench_verified_save(url, r["block_bytes"], batch, args.repeats,
                                                                   args.same_host)
            r["ratios"]["verified_save_vs_save"] = r["gbps"]["store_save_verified"] / r["gbps"]["store_save"]
    rows = [[format_size(r["block_bytes"]), r["blocks_per_call"], r["gbps"]["store_save"], r["gbps"]["raw_write"],
             r["gbps"]["store_load"], r["gbps"]["raw_read"], r["gbps"]["memcpy"], r["ratios"]["save_vs_raw"],
             r["ratios"]["load_vs_raw"], f'{r["ratios"]["save_vs_raw_xxh3"]:.2f}/{r["ratios"]["load_vs_raw_xxh3"]:.2f}',
             r["ratios"]["save_vs_memcpy"], r["ratios"]["load_vs_memcpy"],
             f'{r["control_share"]["save"]:.0%}/{r["control_share"]["load"]:.0%}',
             r["gbps"]["store_save_verified"], r["ratios"]["verified_save_vs_save"]] for r in results]
    print()
    print_table(["block", "blocks/call", "save GB/s", "raw W GB/s", "load GB/s", "raw R GB/s", "memcpy GB/s",
                 "save/raw", "load/raw", "save/load vs raw+xxh3", "save/memcpy", "load/memcpy",
                 "directory share save/load", "verified save GB/s", "verified/save"], rows)
    write_json(args.json, {"benchmark": "datapath", "machine": machine(), "batch_bytes": batch, "same_host": args.same_host,
                           "repeats": args.repeats, "results": results})
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
