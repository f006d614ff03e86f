"""The vLLM connector's paged path with the KV in GPU memory (a GPU host), side by side with raw
NIXL and with plain CUDA copies of the same bytes, in one run.

    python bench/gpu_paged.py [--tokens 4096] [--layers 16] [--repeats 5] [--paths gpu-copy,nixl,hbm] [--json OUT]

Per path a directory and a worker run as processes on loopback. "gpu-copy": blocks in the worker's
DRAM arena, which this process maps (same host) and the GPU copies with (a gather or scatter per
layer); "nixl": the same arena over NIXL UCX (KVSTORE_SAME_HOST=off, as between hosts); "hbm":
blocks in the worker's HBM tier (GPU memory of the worker's process), over NIXL UCX. The engine side
(this process) is `PagedKVWorker` on paged KV in GPU memory ([blocks, heads, 16, 2 x head_dim] per
layer, one allocation, registered once as VRAM), 8 KV heads of 128 dims in bf16: a block is one
16-token page of every layer. Per repeat a new prompt is stored (each layer's page of every block
over NIXL UCX once a CUDA event says the layer is written; whole-block checksums; commit) and
loaded into other pages (layer by layer; checksums verified), then compared byte for byte.
"raw" is the bytes moved with nothing else: for nixl and hbm one NIXL request over exactly the same
descriptors (every layer), for gpu-copy the GPU's gathers or scatters alone;
"cuda pinned" / "cuda pageable" is one `copy_` of the same number of bytes between GPU memory and
page-locked / ordinary host memory. Medians over --repeats after one warm-up; GB/s; JSON + a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, median, print_table, write_json  # noqa: E402

from kvstore.client import DirectoryClient  # noqa: E402
from kvstore.connector import Namespace  # noqa: E402
from kvstore.connector.nixl_rows import on_device, remote_side, slice_rows  # noqa: E402
from kvstore.connector.gpu_copies import gpu_copy_layer  # noqa: E402
from kvstore.connector.vllm.worker import PagedKVWorker  # noqa: E402
from kvstore.core.keys import block_hashes  # noqa: E402
from tests.paged import load_pages, save_pages  # noqa: E402

HEADS, HEAD_DIM, PAGE_TOKENS = 8, 128, 16


def synced(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def layer_pages(worker: PagedKVWorker, layer: int, block_ids: list[int], locations):
    """(cache, (page address, runs) per block, page bytes) of one layer, as the connector addresses them."""
    cache = worker.caches[worker.layer_names[layer]]
    step = cache.stride(0) * cache.element_size()
    return cache, [(cache.data_ptr() + b * step, loc.runs) for b, loc in zip(block_ids, locations)], cache[0].nbytes


def raw_nixl(worker: PagedKVWorker, op: str, block_ids: list[int], locations) -> float:
    """One NIXL request moving every layer's page of the blocks, the connector's descriptors."""
    rows = []
    for i in range(len(worker.layer_names)):  # layer i: bytes [i x page, (i+1) x page) of each block
        cache, pages, page = layer_pages(worker, i, block_ids, locations)
        rows.append(slice_rows(pages, i * page, (i + 1) * page, cache.device.index or 0))
    local, remote = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
    raw = worker.agent._raw  # the bench reaches under kvstore's wrapper on purpose
    peer = worker.peers.agent_for(locations[0].worker, locations[0].epoch)
    remote, remote_mem = remote_side(remote, locations[0])  # the worker's HBM on its GPU, or its DRAM
    remote3 = remote if remote.shape[1] == 3 else on_device(remote, 0)  # NIXL's rows name a device
    t0 = time.perf_counter()
    handle = raw.initialize_xfer(op, raw.get_xfer_descs(local, "VRAM"), raw.get_xfer_descs(remote3, remote_mem), peer)
    state = raw.transfer(handle)
    while state != "DONE":
        assert state != "ERR", "the raw NIXL request failed"
        state = raw.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    raw.release_xfer_handle(handle)
    return elapsed


PATHS = {"gpu-copy": ("dram", "auto"), "nixl": ("dram", "off"), "hbm": ("hbm", "auto")}  # (tier, same host)


def raw_gpu(worker: PagedKVWorker, op: str, block_ids: list[int], locations) -> float:
    """The GPU copies alone (a gather or scatter per layer with the mapped arena), nothing else."""
    arena = worker.arenas.view(locations[0])

    def run():
        copies = []
        for i in range(len(worker.layer_names)):
            cache, pages, page = layer_pages(worker, i, block_ids, locations)
            copies.append(gpu_copy_layer(op, pages, i * page, (i + 1) * page, cache, arena))
        for copy in copies:
            copy.settle()
    return synced(run)


def bench_path(path: str, args) -> dict:
    tier, same_host = PATHS[path]
    os.environ["KVSTORE_SAME_HOST"] = same_host  # read when the connector starts
    blocks = args.tokens // PAGE_TOKENS
    nbytes = args.layers * blocks * HEADS * PAGE_TOKENS * 2 * HEAD_DIM * 2
    tier_bytes = str((args.repeats + 2) * nbytes + (64 << 20))
    memory = ("--hbm-bytes", tier_bytes) if tier == "hbm" else ()
    ns = Namespace(model_id=f"bench-gpu-paged-{tier}", num_layers=args.layers, num_kv_heads=HEADS,
                   head_dim=HEAD_DIM, dtype="bfloat16", block_tokens=PAGE_TOKENS, layout="layer_head_token_kvdim")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    pages = torch.zeros((args.layers, 2 * blocks, HEADS, PAGE_TOKENS, 2 * HEAD_DIM), dtype=torch.bfloat16,
                        device="cuda")
    saved, loaded = list(range(blocks)), list(range(blocks, 2 * blocks))
    raw = raw_gpu if path == "gpu-copy" else raw_nixl
    samples: dict[str, list[float]] = {k: [] for k in ("store", "retrieve", "raw_write", "raw_read")}
    with local_stack(dram_bytes=tier_bytes, page_bytes=str(nbytes // blocks), worker_args=memory) as url:
        directory = DirectoryClient(url)
        namespace_id = directory.register_namespace(ns)
        worker = PagedKVWorker(directory, names, (HEADS, PAGE_TOKENS, 2 * HEAD_DIM), torch.bfloat16)
        try:
            worker.register({name: pages[i] for i, name in enumerate(names)})
            for rep in range(args.repeats + 1):
                pages[:, :blocks].normal_()
                pages[:, blocks:].zero_()
                hashes = [h.hex() for h in block_hashes(ns, [rep * args.tokens + t for t in range(args.tokens)])]

                store_s = synced(lambda: save_pages(worker, namespace_id, f"store-{rep}", hashes, saved))
                hits = directory.lookup(namespace_id, hashes, locations=True).blocks
                assert len(hits) == blocks and all(h.location.tier == tier for h in hits), "not all stored in the tier"
                errors: set[int] = set()
                retrieve_s = synced(lambda: errors.update(load_pages(worker, namespace_id, f"load-{rep}", hashes,
                                                                     loaded)))
                assert not errors, "the load reported errors"
                assert torch.equal(pages[:, :blocks].view(torch.int16), pages[:, blocks:].view(torch.int16))
                locations = [h.location for h in hits]
                measured = {"store": store_s, "retrieve": retrieve_s,
                            "raw_write": raw(worker, "WRITE", saved, locations),
                            "raw_read": raw(worker, "READ", loaded, locations)}
                for key, seconds in measured.items() if rep else ():
                    samples[key].append(nbytes / seconds / 1e9)
            posts = dict(worker.posts)
        finally:
            worker.close()
    assert (posts["local"] > 0, posts["nixl"] > 0) == (path == "gpu-copy", path != "gpu-copy"), f"{path}: {posts}"
    gbps = {k: median(v) for k, v in samples.items()}
    return {"path": path, "tier": tier, "bytes": nbytes, "gbps": gbps, "samples_gbps": samples, "posts": posts,
            "ratios": {"store_vs_raw": gbps["store"] / gbps["raw_write"],
                       "retrieve_vs_raw": gbps["retrieve"] / gbps["raw_read"]}}


def cuda_copies(nbytes: int, repeats: int) -> dict:
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, host in (("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        host.fill_(1)
        for direction, fn in (("h2d", lambda: gpu.copy_(host, non_blocking=True)),
                              ("d2h", lambda: host.copy_(gpu, non_blocking=True))):
            out[f"{kind}_{direction}"] = median([nbytes / synced(fn) / 1e9 for _ in range(repeats + 1)][1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help=f"prompt length, a multiple of {PAGE_TOKENS}")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--json", default="bench/out/gpu_paged.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_paged.py needs a CUDA GPU; this host has none")
    results, failed = [], {}
    for path in args.paths.split(","):
        try:
            results.append(bench_path(path, args))
        except Exception as exc:  # noqa: BLE001 - one path failing still reports the others
            failed[path] = f"{type(exc).__name__}: {exc}"
            print(f"{path} failed: {failed[path]}")
    if not results:
        sys.exit("every path failed")
    copies = cuda_copies(results[0]["bytes"], args.repeats)
    rows = [[r["path"], r["gbps"]["store"], r["gbps"]["raw_write"], r["ratios"]["store_vs_raw"],
             r["gbps"]["store"] / copies["pinned_d2h"], r["gbps"]["retrieve"], r["gbps"]["raw_read"],
             r["ratios"]["retrieve_vs_raw"], r["gbps"]["retrieve"] / copies["pinned_h2d"]] for r in results]
    print(f"{results[0]['bytes'] >> 20} MiB a prompt ({args.tokens} tokens, {args.layers} layers); GB/s, medians "
          f"of {args.repeats}; cuda copies: " + ", ".join(f"{k} {v:.1f}" for k, v in copies.items()))
    print_table(["path", "store", "raw write", "x raw", "x pinned d2h", "retrieve", "raw read", "x raw",
                 "x pinned h2d"], rows)
    write_json(args.json, {"machine": {**machine(), "gpu": torch.cuda.get_device_name()}, "tokens": args.tokens,
                           "layers": args.layers, "repeats": args.repeats, "cuda_copies_gbps": copies,
                           "paths": results, "failed": failed})
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
