"""kvstore against LMCache's multiprocess cache server, the same prompts side by side in one run.

    python bench/vs_lmcache.py [--tokens 4096] [--layers 16] [--repeats 5] [--rounds 1] [--json OUT]

Needs LMCache in its own venv: `make setup-lmcache` (`lmcache==0.5.6` beside torch's CPU build
in .venv-lmcache).

The model is 16 layers, 8 KV heads, head_dim 128, bf16 (64 KiB of KV per token, 256 MiB for a
4,096-token prompt). Each side runs in its own process, one after the other:
- LMCache: `lmcache server` on loopback in its engine-driven shared-memory mode (its fastest on
  a CPU host: the engine process copies chunks of 256 tokens in and out of the server's shared
  memory), driven as vLLM's multiprocess connector drives it (`EngineDrivenTransferContext`)
  from vLLM-style paged KV tensors [2, blocks, 16, heads, head_dim] per layer;
- kvstore: a directory and one worker (DRAM tier) as processes on loopback, driven two ways:
  through its tensor API (`KVStoreClient.save` / `load` / `lookup` with per-layer (K, V)
  [heads, tokens, head_dim], blocks of 256 tokens: a packing copy through a staging buffer), and
  as its vLLM connector drives it (`PagedKVWorker` on paged KV [blocks, heads, 16, 2 x head_dim]
  per layer, registered once: each layer's page of every block moves with no staging copy).
  Both copy with the worker's DRAM arena, mapped into the bench's process (same host); with
  KVSTORE_SAME_HOST=off, NIXL over UCX instead. xxh3 checksums on every save and load.
Per repeat a new prompt is stored, looked up (--lookups times: LMCache's lookup is a prefetch
that also takes and releases read locks; kvstore's hashes the tokens and asks the directory),
and retrieved into new tensors, which are compared byte for byte with what was stored.
Medians over --repeats (after one warm-up prompt); ratios kvstore / LMCache; JSON + a table.
With --rounds N the three sides run N times, one after the other, and each round's ratios are
taken against the LMCache of that round: on a shared machine whose speed drifts between runs,
the rounds' ratios and their median say more than one run.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import finish_side, free_port, peer_python, run_side  # noqa: E402
HEADS, HEAD_DIM, CHUNK, PAGE_TOKENS = 8, 128, 256, 16


def prompt(rep: int, tokens: int, layers: int):
    """Token ids and per-layer K, V [tokens, heads, head_dim] bf16 of prompt `rep`, the same on both sides."""
    import torch

    g = torch.Generator().manual_seed(rep)
    ids = torch.randint(0, 32000, (tokens,), generator=g).tolist()
    kv = [tuple(torch.randn((tokens, HEADS, HEAD_DIM), generator=g).to(torch.bfloat16) for _ in "KV")
          for _ in range(layers)]
    return ids, kv


def measure(ops, args) -> dict:
    """ops: prepare(rep), store(rep), lookup(rep) -> hit tokens, retrieve(rep), same() -> True if
    the bytes retrieved are the bytes stored (not timed)."""
    store_s, retrieve_s, lookup_s = [], [], []
    for rep in range(args.repeats + 1):  # prompt 0 warms connections and memory up
        ops.prepare(rep)
        t0 = time.perf_counter()
        ops.store(rep)
        stored = time.perf_counter() - t0
        lookups = []
        for _ in range(args.lookups):
            t0 = time.perf_counter()
            hit = ops.lookup(rep)
            lookups.append(time.perf_counter() - t0)
            assert hit == args.tokens, f"lookup found {hit} of {args.tokens} stored tokens"
        t0 = time.perf_counter()
        ops.retrieve(rep)
        retrieved = time.perf_counter() - t0
        assert ops.same(), "retrieve returned other bytes than were stored"
        if rep:
            store_s.append(stored)
            retrieve_s.append(retrieved)
            lookup_s.append(statistics.median(lookups))
    nbytes = args.tokens * args.layers * 2 * HEADS * HEAD_DIM * 2
    return {"kv_bytes": nbytes, "store_gbps": nbytes / statistics.median(store_s) / 1e9,
            "retrieve_gbps": nbytes / statistics.median(retrieve_s) / 1e9,
            "store_ms": statistics.median(store_s) * 1e3, "retrieve_ms": statistics.median(retrieve_s) * 1e3,
            "lookup_ms": statistics.median(lookup_s) * 1e3}


# ---- LMCache side (runs in .venv-lmcache) ---------------------------------------------------

class LMCacheOps:
    def __init__(self, port: int, args) -> None:
        import torch
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.args, self.torch = args, torch
        self.zmq = zmq.Context()
        self.client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=self.zmq)
        self.chunk = int(self.client.get_chunk_size().result(timeout=30))
        assert self.chunk == CHUNK, f"server chunk size {self.chunk}"
        blocks = args.tokens // PAGE_TOKENS
        shape = (2, blocks, PAGE_TOKENS, HEADS, HEAD_DIM)
        self.src = {f"model.layers.{i}.self_attn.attn": torch.empty(shape, dtype=torch.bfloat16)
                    for i in range(args.layers)}
        self.dst = {name: torch.empty_like(t) for name, t in self.src.items()}
        self.block_ids = [list(range(blocks))]
        self.context = EngineDrivenTransferContext(1000, self.client)
        self.context.register(self.src, "bench", 1, CHUNK // PAGE_TOKENS, 30, layout_hints={"kv_layout": "NHD"},
                              engine_group_infos=[EngineGroupInfo(engine_group_id=0,
                                                                  layer_indices=tuple(range(args.layers)),
                                                                  tokens_per_block=PAGE_TOKENS)],
                              engine_type=EngineType.VLLM)
        self.ids: list[int] = []
        self.serial = 0

    def key(self, request: str, worker):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name="bench", world_size=1, worker_id=worker, token_ids=tuple(self.ids),
                                 start=0, end=len(self.ids), request_id=request, num_kv_readers=1)

    def prepare(self, rep: int) -> None:
        self.ids, kv = prompt(rep, self.args.tokens, self.args.layers)
        for (k, v), t in zip(kv, self.src.values()):
            t[0].view(-1, HEADS, HEAD_DIM).copy_(k)
            t[1].view(-1, HEADS, HEAD_DIM).copy_(v)
        for t in self.dst.values():
            t.zero_()

    def store(self, rep: int) -> None:
        request = f"store-{rep}"
        assert self.context.submit_store(request, self.key(request, 0), self.src, self.block_ids, None,
                                         CHUNK // PAGE_TOKENS).result(timeout=120), "store failed"
        self.client.end_session(request).result(timeout=30)

    def lookup(self, rep: int) -> int:
        self.serial += 1
        request = f"lookup-{rep}-{self.serial}"
        key = self.key(request, None)
        self.client.lookup(key, 1).result(timeout=30)
        chunks = self.client.wait_prefetch_status(request, 30).result(timeout=35) or 0
        self.client.free_lookup_locks(key, 1).result(timeout=30)
        self.client.end_session(request).result(timeout=30)
        return chunks * self.chunk

    def retrieve(self, rep: int) -> None:
        request = f"retrieve-{rep}"
        self.client.lookup(self.key(request, None), 1).result(timeout=30)
        chunks = self.client.wait_prefetch_status(request, 30).result(timeout=35) or 0
        assert chunks * self.chunk == len(self.ids), "the prompt was not found before retrieve"
        assert self.context.submit_retrieve(request, self.key(request, 0), self.dst, self.block_ids, None,
                                            CHUNK // PAGE_TOKENS).result(timeout=120), "retrieve failed"
        self.client.end_session(request).result(timeout=30)

    def same(self) -> bool:
        return all(self.torch.equal(self.src[n].view(self.torch.int16), self.dst[n].view(self.torch.int16))
                   for n in self.src)

    def close(self) -> None:
        done = self.context.unregister()
        if done is not None:
            done.result(timeout=30)
        self.context.close()
        self.client.close()
        self.zmq.term()


def lmcache_side(args) -> dict:
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    port, log_path = free_port(), Path(args.tmp) / "lmcache.log"
    size_gb = (args.repeats + 2) * args.tokens * args.layers * 2 * HEADS * HEAD_DIM * 2 / 2**30
    server = subprocess.Popen([str(Path(sys.executable).parent / "lmcache"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(free_port()),
                               "--chunk-size", str(CHUNK), "--supported-transfer-mode", "engine_driven",
                               "--shm-name", f"kvbench{os.getpid()}", "--l1-size-gb", f"{size_gb:.2f}",
                               "--no-l1-use-lazy", "--eviction-policy", "LRU", "--disable-observability"],
                              stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Application startup complete" not in log_path.read_text(errors="replace"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not come up; see {log_path}")
            time.sleep(0.2)
        ops = LMCacheOps(port, args)
        try:
            return measure(ops, args)
        finally:
            ops.close()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


# ---- kvstore side ---------------------------------------------------------------------------

class KVStoreOps:
    def __init__(self, url: str, args) -> None:
        from kvstore.connector import KVStoreClient, Namespace

        self.args = args
        ns = Namespace(model_id="bench-vs-lmcache", num_layers=args.layers, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype="bfloat16", block_tokens=CHUNK)
        self.client = KVStoreClient(url, ns, staging_bytes=args.tokens // CHUNK * ns.block_nbytes)
        self.ids, self.kv, self.got = [], [], []
        self.save_phases: list[dict] = []  # per call: the client's phases; "call" - "wall" = (un)packing
        self.load_phases: list[dict] = []

    def prepare(self, rep: int) -> None:
        self.ids, kv = prompt(rep, self.args.tokens, self.args.layers)
        self.kv = [(k.permute(1, 0, 2).contiguous(), v.permute(1, 0, 2).contiguous()) for k, v in kv]

    def store(self, rep: int) -> None:
        t0 = time.perf_counter()
        assert self.client.save(self.ids, self.kv) == self.args.tokens, "save stored fewer tokens"
        self.save_phases.append({**self.client.last_timings, "call": time.perf_counter() - t0})

    def lookup(self, rep: int) -> int:
        return self.client.lookup(self.ids)

    def retrieve(self, rep: int) -> None:
        t0 = time.perf_counter()
        self.got, n = self.client.load(self.ids)
        self.load_phases.append({**self.client.last_timings, "call": time.perf_counter() - t0, "n": n})

    def close(self) -> None:
        self.client.close()

    def same(self) -> bool:
        import torch

        return self.load_phases[-1]["n"] == self.args.tokens and all(
            torch.equal(a.view(torch.int16), b.view(torch.int16)) for pair, got in zip(self.kv, self.got)
            for a, b in zip(pair, got))


class PagedOps:
    """kvstore as its vLLM connector drives it: `PagedKVWorker` moves each layer's page of every
    block straight between the engine's registered paged KV ([blocks, heads, 16, 2 x head_dim] per
    layer, vLLM's CPU layout) and the worker, one request per layer, with no staging copy."""

    def __init__(self, url: str, args) -> None:
        import torch

        from kvstore.client import DirectoryClient
        from kvstore.connector import Namespace
        from kvstore.connector.vllm.worker import PagedKVWorker

        self.args, self.torch = args, torch
        self.ns = Namespace(model_id="bench-vs-lmcache-paged", num_layers=args.layers, num_kv_heads=HEADS,
                            head_dim=HEAD_DIM, dtype="bfloat16", block_tokens=PAGE_TOKENS,
                            layout="layer_head_token_kvdim")
        self.directory = DirectoryClient(url)
        self.namespace_id = self.directory.register_namespace(self.ns)
        self.blocks = args.tokens // PAGE_TOKENS  # the prompt's pages are 0..n-1; a load goes to n..2n-1
        pages = torch.zeros((args.layers, 2 * self.blocks, HEADS, PAGE_TOKENS, 2 * HEAD_DIM), dtype=torch.bfloat16)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
        self.caches = {name: pages[i] for i, name in enumerate(self.names)}  # one allocation, as vLLM's
        self.worker = PagedKVWorker(self.directory, self.names, (HEADS, PAGE_TOKENS, 2 * HEAD_DIM), torch.bfloat16)
        self.worker.register(self.caches)
        self.ids: list[int] = []
        self.hashes: list[str] = []

    def prepare(self, rep: int) -> None:
        from kvstore.core.keys import block_hashes

        self.ids, kv = prompt(rep, self.args.tokens, self.args.layers)
        self.hashes = [h.hex() for h in block_hashes(self.ns, self.ids)]
        n = self.blocks
        for (k, v), name in zip(kv, self.names):
            page = self.caches[name]
            page[:n, :, :, :HEAD_DIM] = k.view(n, PAGE_TOKENS, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
            page[:n, :, :, HEAD_DIM:] = v.view(n, PAGE_TOKENS, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
            page[n:].zero_()

    def store(self, rep: int) -> None:
        from tests.paged import save_pages

        # as the forward hands each layer over, then until the save is committed
        save_pages(self.worker, self.namespace_id, f"store-{rep}", self.hashes, list(range(self.blocks)))
        assert self.lookup(rep) == self.args.tokens, "the paged save did not commit every block"

    def lookup(self, rep: int) -> int:
        return self.directory.lookup(self.namespace_id, self.hashes).num_hit_blocks * PAGE_TOKENS

    def retrieve(self, rep: int) -> None:
        from tests.paged import load_pages

        # as the forward waits for each layer; the step's end verifies the checksums and releases the lease
        failed = load_pages(self.worker, self.namespace_id, f"load-{rep}", self.hashes,
                            list(range(self.blocks, 2 * self.blocks)))
        assert not failed, "the paged load reported errors"

    def same(self) -> bool:
        n = self.blocks
        return all(self.torch.equal(p[:n].view(self.torch.int16), p[n:].view(self.torch.int16))
                   for p in self.caches.values())

    def close(self) -> None:
        self.worker.close()


def kvstore_side(args) -> dict:
    from common import local_stack

    dram = (args.repeats + 2) * args.tokens * args.layers * 2 * HEADS * HEAD_DIM * 2 + (64 << 20)
    paged = args.side == "kvstore-paged"
    with local_stack(dram_bytes=str(dram), page_bytes="1MiB" if paged else "2MiB") as url:
        ops = PagedOps(url, args) if paged else KVStoreOps(url, args)
        try:
            result = measure(ops, args)
        finally:
            ops.close()
    if not paged:
        for name, runs in (("save_phases_ms", ops.save_phases[1:]), ("load_phases_ms", ops.load_phases[1:])):
            result[name] = {k: statistics.median(r.get(k, 0.0) for r in runs) * 1e3 for k in runs[0] if k != "n"}
    return result


# ---- the run --------------------------------------------------------------------------------

def side_argv(args) -> list[str]:
    return ["--tokens", str(args.tokens), "--layers", str(args.layers), "--lookups", str(args.lookups),
            "--repeats", str(args.repeats)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help=f"prompt length, a multiple of {CHUNK}")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--lookups", type=int, default=50, help="lookups per prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the three sides this many times, one after the other; ratios per round, "
                        "and their median")
    parser.add_argument("--json", default="bench/out/vs_lmcache.json")
    parser.add_argument("--side", choices=("lmcache", "kvstore", "kvstore-paged"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return finish_side((lmcache_side if args.side == "lmcache" else kvstore_side)(args), args.out)
    if args.tokens <= 0 or args.tokens % CHUNK or args.layers < 1 or args.lookups < 1 or args.repeats < 1 \
            or args.rounds < 1:
        sys.exit(f"error: --tokens must be a positive multiple of {CHUNK}; --layers, --lookups, --repeats, --rounds "
                 "positive")
    lmcache_python = peer_python(".venv-lmcache", "setup-lmcache")
    from common import machine, print_table, write_json

    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvstore-vs-lmcache-") as tmp:
        args.tmp = tmp
        for k in range(args.rounds):
            said = f"round {k + 1} of {args.rounds}: " if args.rounds > 1 else ""
            print(f"{said}LMCache ...", flush=True)
            lm = run_side(lmcache_python, __file__, "lmcache", side_argv(args), tmp, {"LMCACHE_TRACK_USAGE": "false"})
            print(f"{said}kvstore (tensor API) ...", flush=True)
            kv = run_side(sys.executable, __file__, "kvstore", side_argv(args), tmp)
            print(f"{said}kvstore (paged, as its vLLM connector) ...", flush=True)
            paged = run_side(sys.executable, __file__, "kvstore-paged", side_argv(args), tmp)
            rounds.append({"lmcache": lm, "kvstore": kv, "kvstore_paged": paged, "ratios": ratios_of(lm, kv, paged)})
    sides = {side: {key: statistics.median(r[side][key] for r in rounds) for key in rounds[0][side]
                    if isinstance(rounds[0][side][key], (int, float))}
             for side in ("lmcache", "kvstore", "kvstore_paged")}
    lm, kv, paged = sides["lmcache"], sides["kvstore"], sides["kvstore_paged"]
    print()
    if args.rounds > 1:
        print(f"each figure: the median over {args.rounds} rounds of that side's median over its prompts")
    print_table(["", "store GB/s", "retrieve GB/s", "store ms", "retrieve ms", "lookup ms"],
                [[name, s["store_gbps"], s["retrieve_gbps"], s["store_ms"], s["retrieve_ms"], s["lookup_ms"]]
                 for name, s in (("LMCache", lm), ("kvstore tensor API", kv), ("kvstore paged", paged))])
    ratios = {name: {key: statistics.median(r["ratios"][name][key] for r in rounds) for key in RATIOS}
              for name in ("tensor_api", "paged")}
    for name in ratios:
        each = "" if args.rounds == 1 else " (rounds: retrieve " + ", ".join(
            f"{r['ratios'][name]['retrieve']:.2f}x" for r in rounds) + ")"
        print(f"kvstore {name} / LMCache: store {ratios[name]['store']:.2f}x, retrieve "
              f"{ratios[name]['retrieve']:.2f}x; lookups {ratios[name]['lookup_speedup']:.2f}x as fast{each}")
    for op in ("save", "load"):
        phases = {k: statistics.median(r["kvstore"][f"{op}_phases_ms"][k] for r in rounds)
                  for k in rounds[0]["kvstore"][f"{op}_phases_ms"]}
        print(f"kvstore {op} phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    write_json(args.json, {"benchmark": "vs_lmcache", "machine": machine(), "tokens": args.tokens,
                           "layers": args.layers, "repeats": args.repeats, "rounds": rounds,
                           "lmcache": lm, "kvstore": kv, "kvstore_paged": paged, "ratios": ratios})


RATIOS = ("store", "retrieve", "lookup_speedup")


def ratios_of(lm: dict, kv: dict, paged: dict) -> dict:
    """kvstore's two ways against LMCache, from one round's sides."""
    return {name: {"store": side["store_gbps"] / lm["store_gbps"],
                   "retrieve": side["retrieve_gbps"] / lm["retrieve_gbps"],
                   "lookup_speedup": lm["lookup_ms"] / side["lookup_ms"]}
            for name, side in (("tensor_api", kv), ("paged", paged))}

if __name__ == "__main__":
    main()
