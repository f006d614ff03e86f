"""kvstore against Mooncake Store, the same work side by side in one run.

    python bench/vs_mooncake.py [--sizes 256KiB,1MiB,4MiB] [--batch-bytes 64MiB] [--keys 100000] [--json OUT]

Needs Mooncake in its own venv: `make setup-mooncake` (Debian's libibverbs1/librdmacm1/libnuma1
and `mooncake-transfer-engine-non-cuda` from PyPI in .venv-mooncake).

Each side runs in its own process, one after the other, on the same machine:
- Mooncake: `mooncake_master` (loopback, metadata P2PHANDSHAKE), one store process that
  mounts the memory segment, and a client process that mounts none, protocol `tcp`;
- kvstore: a directory and one worker (DRAM tier) as processes, and a KVStoreClient: once as on
  one host (blocks copied through the worker's mapped arena), and twice as across hosts, over
  UCX_TLS=tcp without the arena (`same_host="off"`), its gets pushed by the worker
  (`load_push="on"`) and pulled (READ by the engine, "off").

Both clients move bytes from buffers they registered once. Per side:
1. ingest: `--keys` 4 KiB objects in batches of 128 (batch_put_from / save_blocks), keys/s;
2. existence of 128 stored keys (batch_is_exist / POST /v1/lookup), `--lookups` times
   from one client: p50, p99, lookups/s. kvstore answers the cached prefix, Mooncake each key;
   for 128 stored keys both answer "all 128";
   then both again from each count of `--clients` above 1: that many client processes at once
   (each its own store client and registered buffer), `--keys` new keys split between them and
   `--lookups` lookups each; keys/s and lookups/s of them all, p50/p99 over all their calls;
3. bulk put and get of `--batch-bytes` per call at each block size (batch_put_from /
   batch_get_into vs save_blocks / load_blocks, which include the xxh3 checksums and the
   directory's prepare/complete), GB/s, every get compared byte for byte with what was put.
Medians over --repeats; ratios kvstore / Mooncake; JSON + a table.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # kvstore.core.sizes imports only the standard library: both venvs
from peers import finish_side, free_port, peer_python, run_side  # noqa: E402

from kvstore.core.sizes import parse_size  # noqa: E402
SMALL = 4096  # bytes of one ingest/lookup object
BATCH = 128  # keys per ingest call and per lookup
TOKEN_BYTES = 2 * 8 * 128 * 2  # kvstore namespace: K and V of 8 heads x 128 dims in bf16


def key(i: int, tag: str) -> bytes:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def concurrent_client(make_ops, index: int, keys: range, lookups: int, ready, start, look, out) -> None:
    """One of several client processes: ingest `keys`, then `lookups` lookups of 128 of them, each
    phase started with the others (`start`, then `look`); puts (ingest seconds, stored), then the
    lookup latencies."""
    ops = make_ops[0](*make_ops[1:])
    arena = np.random.default_rng(index).integers(0, 256, BATCH * SMALL, dtype=np.uint8)
    ops.register(arena)
    small = [arena[i * SMALL:(i + 1) * SMALL] for i in range(BATCH)]
    ready.put(index)
    start.wait()
    t0, stored = time.perf_counter(), 0
    for first in range(keys.start, keys.stop, BATCH):
        batch = [key(i, "many") for i in range(first, min(first + BATCH, keys.stop))]
        stored += ops.put(batch, small[: len(batch)])
    out.put((time.perf_counter() - t0, stored))
    look.wait()
    rng, latencies = np.random.default_rng(100 + index), []
    for _ in range(lookups):
        first = keys.start + int(rng.integers(0, (keys.stop - keys.start) // BATCH)) * BATCH
        t0 = time.perf_counter()
        found = ops.exist([key(i, "many") for i in range(first, first + BATCH)])
        latencies.append(time.perf_counter() - t0)
        assert found == BATCH, f"lookup found {found} of {BATCH} stored keys"
    out.put(latencies)


def concurrently(make_ops, clients: int, first_key: int, args) -> dict:
    """`clients` processes ingesting `--keys` new keys between them, then looking them up."""
    ctx = mp.get_context("spawn")
    ready, start, look, out = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue()
    share = args.keys // clients // BATCH * BATCH
    procs = [ctx.Process(target=concurrent_client, args=(make_ops, i, range(first_key + i * share,
                         first_key + (i + 1) * share), args.lookups, ready, start, look, out)) for i in range(clients)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=300)
    start.set()
    ingested = [out.get(timeout=1800) for _ in procs]
    t0 = time.perf_counter()
    look.set()
    latencies = [x for _ in procs for x in out.get(timeout=1800)]
    lookup_s = time.perf_counter() - t0
    for proc in procs:
        proc.join()
    stored = sum(n for _, n in ingested)
    assert stored == share * clients, f"ingest stored {stored} of {share * clients} keys"
    ingest_s = max(s for s, _ in ingested)  # all of them started together
    return {"clients": clients, "ingest_keys_per_s": stored / ingest_s,
            "lookup": {"p50_ms": percentile(latencies, 0.5) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
                       "per_s": len(latencies) / lookup_s}}


def workload(ops, args, make_ops=None) -> dict:
    """The same steps for both stores. `ops` has put(keys, views) -> stored, get(keys, views) ->
    got, exist(keys) -> how many of them exist, drop(keys); `make_ops`: (class, args...) that make
    another in a client process."""
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch_bytes = parse_size(args.batch_bytes)
    arena = np.empty(max(batch_bytes, BATCH * SMALL) * 2, dtype=np.uint8)
    ops.register(arena)
    src, dst = arena[: arena.size // 2], arena[arena.size // 2:]
    src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
    out: dict = {}
    small = [src[i * SMALL:(i + 1) * SMALL] for i in range(BATCH)]
    t0, stored = time.perf_counter(), 0
    for first in range(0, args.keys, BATCH):
        keys = [key(i, "small") for i in range(first, min(first + BATCH, args.keys))]
        stored += ops.put(keys, small[: len(keys)])
    out["ingest_keys_per_s"] = stored / (time.perf_counter() - t0)
    assert stored == args.keys, f"ingest stored {stored} of {args.keys} keys"
    rng, latencies = np.random.default_rng(1), []
    for _ in range(args.lookups):
        first = int(rng.integers(0, args.keys // BATCH)) * BATCH
        keys = [key(i, "small") for i in range(first, first + BATCH)]
        t0 = time.perf_counter()
        found = ops.exist(keys)
        latencies.append(time.perf_counter() - t0)
        assert found == BATCH, f"lookup found {found} of {BATCH} stored keys"
    out["lookup"] = {"p50_ms": percentile(latencies, 0.5) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
                     "per_s": len(latencies) / sum(latencies)}
    out["concurrent"] = [concurrently(make_ops, n, (k + 1) * args.keys, args) for k, n in enumerate(args.clients)
                         if n > 1]
    out["bulk"] = []
    for size in sizes:
        n = batch_bytes // size
        views_src = [src[i * size:(i + 1) * size] for i in range(n)]
        views_dst = [dst[i * size:(i + 1) * size] for i in range(n)]
        put_s, get_s = [], []
        for rep in range(args.repeats + 1):  # round 0 warms connections and memory up
            keys = [key(i, f"bulk-{size}-{rep}") for i in range(n)]
            t0 = time.perf_counter()
            assert ops.put(keys, views_src) == n, "bulk put stored fewer blocks"
            t1 = time.perf_counter()
            dst[: n * size] = 0
            t2 = time.perf_counter()
            assert ops.get(keys, views_dst) == n, "bulk get read fewer blocks"
            t3 = time.perf_counter()
            assert np.array_equal(src[: n * size], dst[: n * size]), "get returned other bytes than put"
            ops.drop(keys)
            if rep:
                put_s.append(t1 - t0)
                get_s.append(t3 - t2)
        out["bulk"].append({"block_bytes": size, "blocks": n, "put_gbps": n * size / statistics.median(put_s) / 1e9,
                            "get_gbps": n * size / statistics.median(get_s) / 1e9})
    return out


# ---- Mooncake side (runs in .venv-mooncake: numpy and mooncake only) -------------------------

class MooncakeOps:
    def __init__(self, master: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise RuntimeError("Mooncake client setup failed")

    def register(self, array: np.ndarray) -> None:
        if self.store.register_buffer(array.ctypes.data, array.nbytes) != 0:
            raise RuntimeError("Mooncake register_buffer failed")

    def put(self, keys: list[bytes], views: list[np.ndarray]) -> int:
        codes = self.store.batch_put_from([k.hex() for k in keys], [v.ctypes.data for v in views],
                                          [v.nbytes for v in views])
        return sum(c == 0 for c in codes)

    def get(self, keys: list[bytes], views: list[np.ndarray]) -> int:
        got = self.store.batch_get_into([k.hex() for k in keys], [v.ctypes.data for v in views],
                                        [v.nbytes for v in views])
        short = [g for g, v in zip(got, views) if g != v.nbytes]
        if short:
            print(f"Mooncake batch_get_into: {len(short)} of {len(views)} short, codes {sorted(set(short))[:5]}")
        return len(views) - len(short)

    def exist(self, keys: list[bytes]) -> int:
        return sum(r == 1 for r in self.store.batch_is_exist([k.hex() for k in keys]))

    def drop(self, keys: list[bytes]) -> None:
        deadline = time.monotonic() + 5  # a get leases the object for --default_kv_lease_ttl
        while any(r not in (0, -704) for r in self.store.batch_remove([k.hex() for k in keys])):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)


def mooncake_side(args) -> dict:
    bin_dir = Path(sys.executable).parent
    port, logs = free_port(), open(Path(args.tmp) / "mooncake.log", "ab")
    master = subprocess.Popen([str(bin_dir / "mooncake_master"), "--rpc_port", str(port), "--rpc_address",
                               "127.0.0.1", "--metrics_port", str(free_port()), "--enable_metric_reporting=false",
                               "--default_kv_lease_ttl", "1000"], stdout=logs, stderr=subprocess.STDOUT)
    # room for everything the run puts, so that no eviction ever takes a key the run reads
    segment = parse_size(args.batch_bytes) * (args.repeats + 1) * len(args.sizes.split(",")) \
        + args.keys * SMALL * (2 + len(args.clients)) \
        + (512 << 20)
    holder = subprocess.Popen([sys.executable, __file__, "--side", "mooncake-segment", "--master",
                               f"127.0.0.1:{port}", "--segment-bytes", str(segment), "--tmp", args.tmp], stdout=logs,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (Path(args.tmp) / "segment-ready").exists():
            if holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Mooncake store process did not come up (see mooncake.log)")
            time.sleep(0.1)
        return workload(MooncakeOps(f"127.0.0.1:{port}"), args, (MooncakeOps, f"127.0.0.1:{port}"))
    finally:
        for proc in (holder, master):
            proc.terminate()
            proc.wait(timeout=15)


def segment_holder(args) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", args.segment_bytes, 16 << 20, "tcp", "", args.master) != 0:
        sys.exit("Mooncake store setup failed")
    (Path(args.tmp) / "segment-ready").touch()
    time.sleep(24 * 3600)


# ---- kvstore side ---------------------------------------------------------------------------

class KVStoreOps:
    def __init__(self, url: str) -> None:
        from kvstore.connector import KVStoreClient, Namespace

        self.url, self.clients = url, {}
        self._client, self._namespace = KVStoreClient, Namespace
        self.arena = None

    def client_for(self, nbytes: int):
        """One client per block size (a namespace fixes the block size), sharing one registration."""
        if nbytes not in self.clients:
            ns = self._namespace(model_id=f"vs-mooncake-{nbytes}", num_layers=1, num_kv_heads=8, head_dim=128,
                                 dtype="bfloat16", block_tokens=nbytes // TOKEN_BYTES)
            client = self._client(self.url, ns, staging_bytes=nbytes)
            client.register_buffer(self.arena)
            self.clients[nbytes] = client
        return self.clients[nbytes]

    def register(self, array: np.ndarray) -> None:
        self.arena = array

    def put(self, keys: list[bytes], views: list[np.ndarray]) -> int:
        return self.client_for(views[0].nbytes).save_blocks(keys, views)

    def get(self, keys: list[bytes], views: list[np.ndarray]) -> int:
        return self.client_for(views[0].nbytes).load_blocks(keys, views)

    def exist(self, keys: list[bytes]) -> int:
        client = self.client_for(SMALL)
        return client.directory.lookup(client.namespace_id, [k.hex() for k in keys]).num_hit_blocks

    def drop(self, keys: list[bytes]) -> None:
        for client in self.clients.values():
            if client.namespace.block_nbytes != SMALL:
                client.directory.evict(client.namespace_id)


def kvstore_side(args) -> dict:
    from common import local_stack

    dram = parse_size(args.batch_bytes) * 4 + args.keys * SMALL * (2 + len(args.clients)) + (256 << 20)
    with local_stack(dram_bytes=str(dram), page_bytes="4KiB") as url:
        return workload(KVStoreOps(url), args, (KVStoreOps, url))


# ---- the run --------------------------------------------------------------------------------

def side_argv(args) -> list[str]:
    return ["--sizes", args.sizes, "--batch-bytes", args.batch_bytes, "--keys", str(args.keys), "--lookups",
            str(args.lookups), "--repeats", str(args.repeats), "--clients", ",".join(map(str, args.clients))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="bulk block sizes (multiples of 256 KiB)")
    parser.add_argument("--batch-bytes", default="64MiB", help="bytes per bulk put/get call")
    parser.add_argument("--keys", type=int, default=100_000, help="4 KiB objects ingested before the lookups")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", default="1,4", help="client processes at once for ingest and lookups")
    parser.add_argument("--json", default="bench/out/vs_mooncake.json")
    parser.add_argument("--side", choices=("mooncake", "mooncake-segment", "kvstore"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--segment-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        args.clients = sorted({int(n) for n in args.clients.split(",")})
    except ValueError:
        sys.exit("error: --clients takes a comma-separated list of client counts, such as 1,4")
    if args.clients[0] < 1:
        sys.exit("error: --clients must be positive")
    if args.side == "mooncake-segment":
        return segment_holder(args)
    if args.side:
        return finish_side((mooncake_side if args.side == "mooncake" else kvstore_side)(args), args.out)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % (256 << 10) for s in sizes) or args.keys < BATCH * args.clients[-1] or args.lookups < 1 \
            or args.repeats < 1:
        sys.exit(f"error: sizes must be multiples of 256KiB; --keys at least {BATCH} per client; --lookups and "
                 "--repeats positive")
    mooncake_python = peer_python(".venv-mooncake", "setup-mooncake")
    from common import machine, print_table, write_json

    with tempfile.TemporaryDirectory(prefix="kvstore-vs-mooncake-") as tmp:
        args.tmp = tmp
        print("Mooncake ...", flush=True)
        sides = {"mooncake": run_side(mooncake_python, __file__, "mooncake", side_argv(args), tmp)}
        print("kvstore (UCX default transports) ...", flush=True)
        sides["kvstore"] = run_side(sys.executable, __file__, "kvstore", side_argv(args), tmp)
        for name, push in (("kvstore_tcp_push", "on"), ("kvstore_tcp_pull", "off")):
            print(f"kvstore (UCX_TLS=tcp, no arena, gets {name[-4:]}ed) ...", flush=True)
            sides[name] = run_side(sys.executable, __file__, "kvstore", side_argv(args), tmp,
                                   {"UCX_TLS": "tcp", "KVSTORE_SAME_HOST": "off", "KVSTORE_LOAD_PUSH": push})
    mc = sides["mooncake"]
    print()
    rows = []
    for name, s in sides.items():
        rows.append([name, 1, s["ingest_keys_per_s"], s["lookup"]["p50_ms"], s["lookup"]["p99_ms"], s["lookup"]["per_s"]])
        rows += [[name, c["clients"], c["ingest_keys_per_s"], c["lookup"]["p50_ms"], c["lookup"]["p99_ms"],
                  c["lookup"]["per_s"]] for c in s["concurrent"]]
    print_table(["", "clients", "ingest keys/s", "lookup p50 ms", "lookup p99 ms", "lookups/s"], rows)
    for n in [1] + [c["clients"] for c in mc["concurrent"]]:
        kv, moon = (sides["kvstore"], mc) if n == 1 else (
            next(c for c in side["concurrent"] if c["clients"] == n) for side in (sides["kvstore"], mc))
        print(f"{n} client(s): kvstore / Mooncake: ingest {kv['ingest_keys_per_s'] / moon['ingest_keys_per_s']:.2f}x, "
              f"lookups/s {kv['lookup']['per_s'] / moon['lookup']['per_s']:.2f}x")
    print()
    rows = []
    for i, row in enumerate(mc["bulk"]):
        for name in ("kvstore", "kvstore_tcp_push", "kvstore_tcp_pull"):
            kv = sides[name]["bulk"][i]
            rows.append([f'{row["block_bytes"] >> 10} KiB', name, kv["put_gbps"], row["put_gbps"],
                         kv["put_gbps"] / row["put_gbps"], kv["get_gbps"], row["get_gbps"],
                         kv["get_gbps"] / row["get_gbps"]])
    print_table(["block", "kvstore over", "put GB/s", "Mooncake put", "put ratio", "get GB/s", "Mooncake get",
                 "get ratio"], rows)
    write_json(args.json, {"benchmark": "vs_mooncake", "machine": machine(), "args": {
        k: getattr(args, k) for k in ("sizes", "batch_bytes", "keys", "lookups", "repeats", "clients")}, "sides": sides})


if __name__ == "__main__":
    main()
