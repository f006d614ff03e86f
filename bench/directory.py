"""The directory under load, from outside, through its public HTTP API.

    python bench/directory.py --blocks 1000000 --json bench/out/directory.json

A directory process (SQLite in a temp dir) and a storage worker's control
endpoint in this process (the real page allocator; no NIXL memory: nothing here
moves KV bytes) with a DRAM tier sized to stay under its watermark. Then:

1. fill: `--blocks` blocks stored through prepare_store + complete_store, in
   chains of 128 (a 64k-token prompt at 512 tokens a block);
2. lookups of 128-hash prefixes of stored chains, over HTTP from other
   processes (keep-alive connections): one client, without and with
   locations; four clients at once; four clients while a fifth saves;
3. stalls: one lookup client while work proportional to the tier runs on other
   threads (the first dry-run eviction of the tier, which builds its policy from
   SQL; a second one, which copies the policy; a prepare of 100,000 blocks),
   its p50/p99 during each against the same client's quiet figures just before;
4. prepare+complete of 64 and of 1,024 new blocks (ms, and µs per block);
5. saves from 1 and 4 engines at once (other processes, chains of 128 new
   blocks, prepare + complete as fast as they go): blocks/s and the directory's
   CPU per stored block, from prepare to commit;
6. loads of 256 stored blocks (prepare-batch + complete: every block pinned
   under a lease, then released) and an operator's evictions of 64 blocks
   (dropped: no tier below), after one that builds the tier's policy: ms and
   the directory's CPU per block; and how long that first one took, with the
   longest 64-block save that another connection made meanwhile;
7. lookups from 4 clients with the directory alone on one core and the clients
   on the other (`taskset`-style affinity; on a machine of 2 cores the plain
   4-client figure measures five processes queueing for two cores);
8. the directory's resident memory, and its start-up time to ready when it is
   restarted on the full database.

`--only-stalls` runs the fill and step 3 alone. The directory's settings come
from the environment as well: `KVSTORE_EVICTION_ORDER=directory` keeps the
tiers' eviction orders in its own process (by default they live in a child
process, whose resident memory is reported beside the directory's).

`--directory-src DIR` runs the directory from another checkout (a before/after
comparison on the same machine); `--always-locations` for one that predates the
`locations` field (it always answers them), which is then asked without it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, cpu_s, machine, median, print_table, random_hash, write_json

from kvstore.core import specs
from kvstore.core.keys import Namespace
from kvstore.core.pages import PageAllocator
from kvstore.worker.control import ControlServer
from tests.helpers import free_port, stop, wait_http

NS = Namespace(model_id="bench-directory", num_layers=1, num_kv_heads=1, head_dim=32, dtype="float32",
               block_tokens=16)  # 4 KiB blocks: the directory's cost does not depend on the size
CHAIN = 128
PAGE = NS.block_nbytes


def block_hash(i: int) -> str:
    return random_hash(i // CHAIN, i % CHAIN)


def chain_hashes(chain: int, length: int = CHAIN) -> list[str]:
    return [block_hash(chain * CHAIN + k) for k in range(length)]


class _Connection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body are two writes


class Http:
    """One keep-alive connection; JSON in, JSON out; seconds per call."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = _Connection("127.0.0.1", port)

    def post(self, path: str, body: dict | None, method: str = "POST") -> tuple[dict, float]:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):  # the server closes a connection idle for a few seconds
            try:
                t0 = time.perf_counter()
                self.conn.request(method, path, data, {"content-type": "application/json"})
                response = self.conn.getresponse()
                payload = response.read()
                elapsed = time.perf_counter() - t0
                break
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = _Connection("127.0.0.1", self.port)
                if attempt:
                    raise
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {payload[:300]!r}")
        return json.loads(payload), elapsed


def store_chain(http: Http, namespace_id: str, hashes: list[str], parent: str | None = None) -> tuple[int, float]:
    """prepare + complete; returns (blocks committed, seconds for both calls)."""
    blocks = [{"hash": h, "parent": p, "nbytes": PAGE} for h, p in zip(hashes, [parent] + hashes[:-1])]
    prepared, t1 = http.post("/v1/store/prepare", {"namespace_id": namespace_id, "blocks": blocks})
    admitted = [b["hash"] for b in prepared["blocks"] if b["status"] == "admitted"]
    if not admitted:
        return 0, t1
    done, t2 = http.post("/v1/store/complete", {"token": prepared["token"], "blocks": [
        {"hash": h, "ok": True, "checksum": "0123456789abcdef"} for h in admitted]})
    return done["committed"], t1 + t2


def lookup_client(port: int, namespace_id: str, chains: int, seconds: float, locations: bool, seed: int,
                  out: mp.Queue, stop=None, cpus: set[int] | None = None) -> None:
    """Lookups for `seconds` (or until `stop` is set); puts (latencies, full hits, start times)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    http, rng, latencies, hits, starts = Http(port), random.Random(seed), [], 0, []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
        body = {"namespace_id": namespace_id, "hashes": chain_hashes(rng.randrange(chains))}
        if locations is True:
            body["locations"] = True
        starts.append(time.time())
        answer, elapsed = http.post("/v1/lookup", body)
        latencies.append(elapsed)
        hits += answer["num_hit_blocks"] == CHAIN
    out.put((latencies, hits, starts))


def saver_client(port: int, namespace_id: str, first_chain: int, seconds: float, out: mp.Queue,
                 length: int = 16) -> None:
    http, stored, chain = Http(port), 0, first_chain
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        stored += store_chain(http, namespace_id, chain_hashes(chain, length))[0]
        chain += 1
    out.put(stored)


def saves(port: int, pid: int, namespace_id: str, clients: int, seconds: float, first_chain: int) -> dict:
    """`clients` engines saving new chains of CHAIN blocks at once: blocks/s and directory CPU per block."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=saver_client, args=(port, namespace_id, first_chain + i * 1_000_000, seconds, out,
                                                    CHAIN)) for i in range(clients)]
    for p in procs:
        p.start()
    cpu0 = cpu_s(pid)
    stored = sum(out.get() for _ in procs)
    cpu = cpu_s(pid) - cpu0
    for p in procs:
        p.join()
    return {"clients": clients, "blocks": stored, "blocks_per_s": stored / seconds,
            "directory_cpu_us_per_block": 1e6 * cpu / max(1, stored)}


def lookups(port: int, pid: int, namespace_id: str, chains: int, clients: int, seconds: float,
            locations: bool = False, saver_from: int | None = None, split_cores: bool = False) -> dict:
    """`split_cores`: the directory on the first CPU, the clients on the others (restored after)."""
    ctx = mp.get_context("spawn")
    out, saved = ctx.Queue(), ctx.Queue()
    cpus = sorted(os.sched_getaffinity(0))
    if split_cores:
        os.sched_setaffinity(pid, {cpus[0]})
    procs = [ctx.Process(target=lookup_client, args=(port, namespace_id, chains, seconds, locations, i, out,
                                                     None, set(cpus[1:]) if split_cores else None))
             for i in range(clients)]
    if saver_from is not None:
        procs.append(ctx.Process(target=saver_client, args=(port, namespace_id, saver_from, seconds, saved)))
    for p in procs:
        p.start()
    cpu0 = cpu_s(pid)
    results = [out.get() for _ in range(clients)]
    stored = saved.get() if saver_from is not None else 0
    cpu = cpu_s(pid) - cpu0  # the clients start and stop within a few ms of each other
    for p in procs:
        p.join()
    if split_cores:
        os.sched_setaffinity(pid, set(cpus))
    latencies = sorted(x for lat, _, _ in results for x in lat)
    return {"clients": clients, "locations": locations, "lookups": len(latencies),
            "per_s": len(latencies) / seconds, "p50_ms": 1e3 * latencies[len(latencies) // 2],
            "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
            "full_hits": sum(h for _, h, _ in results) / max(1, len(latencies)), "saved_meanwhile": stored,
            "directory_cpu_us_per_lookup": 1e6 * cpu / max(1, len(latencies))}


def loads(http: Http, pid: int, namespace_id: str, chains: int, repeats: int, per_load: int = 2) -> dict:
    """prepare-batch of `per_load` stored chains + complete, `repeats` times: an engine's load of a
    prompt (every block pinned under a lease, then released)."""
    rng, times, cpu0 = random.Random(7), [], cpu_s(pid)
    for _ in range(repeats):
        body = {"namespace_id": namespace_id, "reader": "bench",
                "chains": [chain_hashes(rng.randrange(chains)) for _ in range(per_load)]}
        prepared, t1 = http.post("/v1/load/prepare-batch", body)
        assert sum(map(len, prepared["chains"])) == per_load * CHAIN, "a stored chain was not found whole"
        _, t2 = http.post("/v1/load/complete", {"token": prepared["token"], "blocks": []})
        times.append(t1 + t2)
    blocks = per_load * CHAIN
    return {"blocks": blocks, "ms": 1e3 * median(times), "us_per_block": 1e6 * median(times) / blocks,
            "directory_cpu_us_per_block": 1e6 * (cpu_s(pid) - cpu0) / (repeats * blocks)}


def evictions(http: Http, pid: int, namespace_id: str, first_chain: int, repeats: int, blocks: int = 64) -> dict:
    """An operator's eviction of `blocks` blocks' bytes from the DRAM tier (no tier below: dropped),
    `repeats` times after a first one that builds the tier's policy from SQL, during which another
    connection saves 64-block chains: how long the build took and the longest of those saves."""
    ask = {"tier": "dram", "bytes": blocks * PAGE}
    done, saves, failed = threading.Event(), [], []

    def save() -> None:
        saver, chain = Http(http.port), first_chain
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                store_chain(saver, namespace_id, chain_hashes(chain, 64))
            except RuntimeError as exc:  # e.g. its reservation expired while it waited: nothing committed
                failed.append(str(exc)[:200])
            saves.append(time.perf_counter() - t0)
            chain += 1
    saving = threading.Thread(target=save)
    saving.start()
    time.sleep(0.5)
    first = http.post("/v1/admin/evict", ask)[1]
    done.set()
    saving.join()
    times, dropped, cpu0 = [], 0, cpu_s(pid)
    for _ in range(repeats):
        answer, seconds = http.post("/v1/admin/evict", ask)
        times.append(seconds)
        dropped += answer["dropped"]
    return {"blocks": blocks, "ms": 1e3 * median(times), "dropped": dropped,
            "directory_cpu_us_per_block": 1e6 * (cpu_s(pid) - cpu0) / max(1, dropped), "first_s": first,
            "saves_during_first": len(saves), "longest_save_during_first_ms": 1e3 * max(saves, default=0.0),
            "failed_saves_during_first": failed}


def percentiles(latencies: list[float]) -> tuple[float, float]:
    xs = sorted(latencies)
    return 1e3 * xs[len(xs) // 2], 1e3 * xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def lookups_during(port: int, namespace_id: str, chains: int, operation, quiet_s: float = 5.0) -> dict:
    """One lookup client: `quiet_s` alone, then while `operation()` runs in this process (its own
    HTTP connection). p50/p99 of the lookups started in each window."""
    ctx = mp.get_context("spawn")
    out, stop_event = ctx.Queue(), ctx.Event()
    client = ctx.Process(target=lookup_client, args=(port, namespace_id, chains, 3600.0, False, 7, out, stop_event))
    client.start()
    time.sleep(1.0 + quiet_s)  # the client's start-up, then its quiet window
    began = time.time()
    operation()
    ended = time.time()
    stop_event.set()
    latencies, _, starts = out.get()
    client.join()
    quiet = [x for x, t in zip(latencies, starts) if began - quiet_s <= t < began]
    busy = [x for x, t in zip(latencies, starts) if began <= t < ended]
    (q50, q99), (b50, b99) = percentiles(quiet), percentiles(busy or [float("nan")])
    return {"operation_s": ended - began, "quiet_p50_ms": q50, "quiet_p99_ms": q99, "lookups_during": len(busy),
            "p50_ms": b50, "p99_ms": b99, "p99_vs_quiet": b99 / q99}


def stalls(port: int, namespace_id: str, chains: int, first_chain: int) -> dict:
    """Lookups while work proportional to the tier runs: dry-run evictions and a 100,000-block prepare."""
    http = Http(port)
    evict = {"tier": "dram", "limit": 100_000, "dry_run": True}
    out = {"first dry-run evict (policy built from SQL)": lookups_during(
               port, namespace_id, chains, lambda: http.post("/v1/admin/evict", evict)),
           "dry-run evict again (policy copied)": lookups_during(
               port, namespace_id, chains, lambda: http.post("/v1/admin/evict", evict))}

    def prepare() -> None:
        hashes = [random_hash(first_chain, k) for k in range(100_000)]
        blocks = [{"hash": h, "parent": q, "nbytes": PAGE} for h, q in zip(hashes, [None] + hashes[:-1])]
        prepared, _ = http.post("/v1/store/prepare", {"namespace_id": namespace_id, "blocks": blocks})
        http.post("/v1/store/abort", {"token": prepared["token"]})
    out["prepare of 100,000 blocks"] = lookups_during(port, namespace_id, chains, prepare)
    return out


def print_stalls(stalled: dict) -> None:
    print_table(["1 client's lookups while", "took s", "quiet p50 ms", "quiet p99 ms", "p50 ms", "p99 ms",
                 "p99 ÷ quiet"],
                [[n, round(v["operation_s"], 2), v["quiet_p50_ms"], v["quiet_p99_ms"], v["p50_ms"], v["p99_ms"],
                  round(v["p99_vs_quiet"], 2)] for n, v in stalled.items()])


def indexed(http: Http) -> int:
    return http.post("/v1/admin/stats", None, method="GET")[0]["indexed_blocks"]


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children_rss_mib(pid: int) -> float:
    """What the directory's child processes hold (the eviction orders' own process, once started)."""
    children = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):  # a child is listed under the thread that started it
        try:
            children.update((task / "children").read_text().split())
        except OSError:
            pass
    return sum(rss_mib(int(child)) for child in children if os.path.exists(f"/proc/{child}"))


def start_directory(src: Path, port: int, data: Path, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src), "KVSTORE_HEARTBEAT_TIMEOUT_S": "600"}
    # a checkout from before credentials existed has no such flag (and needs none)
    cli = "".join(f.read_text() for f in (src / "kvstore/cli").glob("*.py"))
    open_flag = ["--insecure-no-auth"] if "insecure-no-auth" in cli else []
    return subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "directory", "serve", *open_flag,
                             "--port", str(port), "--data-dir", str(data)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=src, env=env)


def register(url_port: int, control: ControlServer, pages: int, stop_beating) -> None:
    """Register the bench's worker endpoint and keep it alive with heartbeats, as a worker would."""
    import base64
    import threading

    reg = specs.WorkerRegistration(
        name="bench-worker", agent_name="bench-agent", agent_metadata=base64.b64encode(b"none").decode(),
        control_url=control.url, pid=os.getpid(), backends=["UCX"],
        tiers=[specs.TierSpec(kind="dram", capacity_bytes=pages * PAGE, page_bytes=PAGE, base_addr=1 << 30)])
    epoch = Http(url_port).post("/v1/workers", json.loads(reg.model_dump_json()))[0]["epoch"]

    def beat() -> None:
        http = Http(url_port)
        while not stop_beating.wait(1.0):
            http.post("/v1/workers/bench-worker/heartbeat", {"epoch": epoch})
    threading.Thread(target=beat, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0, help="per lookup phase")
    parser.add_argument("--repeats", type=int, default=20, help="prepare+complete calls per size")
    parser.add_argument("--directory-src", type=Path, default=REPO)
    parser.add_argument("--always-locations", action="store_true",
                        help="the directory predates the `locations` field (it always answers them)")
    parser.add_argument("--only-stalls", action="store_true",
                        help="the fill, then only the lookups during tier-sized work (step 3)")
    parser.add_argument("--json")
    args = parser.parse_args()
    chains = max(1, args.blocks // CHAIN)
    # stays under the high watermark (no demotion starts), with room for the savers' blocks
    pages = int(chains * CHAIN * 1.25) + 100_000 + int(args.seconds * 200_000)
    control = ControlServer({"dram": PageAllocator(pages, PAGE)})
    control.start()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-dir-") as tmp:
        log = open(Path(tmp) / "directory.log", "wb")
        directory = start_directory(args.directory_src, port, Path(tmp), log)
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz?workers=0", proc=directory)
            stop_beating = threading.Event()
            register(port, control, pages, stop_beating)
            http = Http(port)
            namespace_id = http.post("/v1/namespaces", {"namespace": NS.to_dict()})[0]["namespace_id"]
            t0 = time.perf_counter()
            for c in range(chains):
                store_chain(http, namespace_id, chain_hashes(c))
                if c % 500 == 0:
                    print(f"\rfill: {c * CHAIN:>9,} / {chains * CHAIN:,} blocks", end="", flush=True)
            fill_s = time.perf_counter() - t0
            print(f"\rfill: {chains * CHAIN:,} blocks in {fill_s:.0f} s ({chains * CHAIN / fill_s:,.0f} blocks/s)")
            rss = rss_mib(directory.pid)
            pid = directory.pid
            if args.only_stalls:
                stalled = stalls(port, namespace_id, chains, chains + 50_000)
                print_stalls(stalled)
                resident = {"filled": rss, "after_dry_runs": rss_mib(pid), "children": children_rss_mib(pid)}
                print(f"directory RSS {resident['filled']:,.0f} MiB after the fill, {resident['after_dry_runs']:,.0f} "
                      f"MiB after the dry runs; its child processes {resident['children']:,.0f} MiB")
                write_json(args.json, {"machine": machine(), "blocks": chains * CHAIN, "stalls": stalled,
                                       "rss_mib": resident, "directory_src": str(args.directory_src)})
                control.stop()
                return
            phases = [lookups(port, pid, namespace_id, chains, 1, args.seconds),
                      lookups(port, pid, namespace_id, chains, 1, args.seconds,
                              locations="always" if args.always_locations else True),
                      lookups(port, pid, namespace_id, chains, 4, args.seconds),
                      lookups(port, pid, namespace_id, chains, 4, args.seconds, saver_from=chains + 10)]
            if len(os.sched_getaffinity(0)) > 1:
                phases.append(lookups(port, pid, namespace_id, chains, 4, args.seconds, split_cores=True))
            stalled = stalls(port, namespace_id, chains, chains + 50_000)
            rss_stalls = (rss_mib(pid), indexed(http), children_rss_mib(pid))  # the dry runs built the tier's policy
            stores = {}
            next_chain = chains + 100_000
            for size in (64, 1024):
                times = []
                for _ in range(args.repeats):
                    n, seconds = store_chain(http, namespace_id, [random_hash(next_chain, k) for k in range(size)])
                    assert n == size, f"stored {n} of {size}"
                    times.append(seconds)
                    next_chain += 1
                stores[size] = {"ms": 1e3 * median(times), "us_per_block": 1e6 * median(times) / size}
            engines = [saves(port, pid, namespace_id, n, args.seconds, next_chain + 10_000_000 * n) for n in (1, 4)]
            loaded = loads(http, pid, namespace_id, chains, args.repeats)
            evicted = evictions(http, pid, namespace_id, next_chain + 50_000_000, args.repeats)
            rss_after = (rss_mib(directory.pid), indexed(http))
        finally:
            stop_beating.set()
            stop(directory)
        t0 = time.perf_counter()
        directory = start_directory(args.directory_src, port, Path(tmp), log)
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz?workers=0", timeout_s=600, proc=directory)
            start_s = time.perf_counter() - t0
            rss_restart = rss_mib(directory.pid)
        finally:
            stop(directory)
    control.stop()

    names = ["1 client", "1 client, locations", "4 clients", "4 clients + 1 saving",
             "4 clients, directory on its own core"][:len(phases)]
    print_table(["lookups of 128 hashes", "lookups/s", "p50 ms", "p99 ms", "full hits", "saved meanwhile",
                 "directory CPU µs/lookup"],
                [[n, round(p["per_s"]), p["p50_ms"], p["p99_ms"], p["full_hits"], p["saved_meanwhile"],
                  round(p["directory_cpu_us_per_lookup"])] for n, p in zip(names, phases)])
    print()
    print_stalls(stalled)
    print()
    print_table(["prepare+complete", "ms", "µs per block"], [[f"{k} blocks", v["ms"], v["us_per_block"]]
                                                            for k, v in stores.items()])
    print()
    print_table(["load (prepare-batch + complete) / eviction", "ms", "directory CPU µs per block"],
                [[f"load of {loaded['blocks']} blocks", loaded["ms"], loaded["directory_cpu_us_per_block"]],
                 [f"eviction of {evicted['blocks']} blocks (dropped {evicted['dropped']})", evicted["ms"],
                  evicted["directory_cpu_us_per_block"]]])
    print(f"the first eviction (the tier's policy built) took {evicted['first_s']:.2f} s; "
          f"{evicted['saves_during_first']} saves of 64 blocks meanwhile, the longest "
          f"{evicted['longest_save_during_first_ms']:.0f} ms, {len(evicted['failed_saves_during_first'])} failed "
          f"{evicted['failed_saves_during_first'][:1]}")
    print()
    print_table(["engines saving at once", "blocks/s", "directory CPU µs per block"],
                [[e["clients"], round(e["blocks_per_s"]), e["directory_cpu_us_per_block"]] for e in engines])
    print(f"\nindexed {chains * CHAIN:,} blocks; fill {chains * CHAIN / fill_s:,.0f} blocks/s; directory RSS "
          f"{rss:,.0f} MiB after the fill, {rss_stalls[0]:,.0f} MiB after the dry runs ({rss_stalls[1]:,} blocks; "
          f"its child processes {rss_stalls[2]:,.0f} MiB), "
          f"{rss_after[0]:,.0f} MiB after the run ({rss_after[1]:,} blocks), {rss_restart:,.0f} MiB after a "
          f"restart; restart to ready {start_s:.1f} s")
    write_json(args.json, {"machine": machine(), "blocks": chains * CHAIN, "fill_s": fill_s,
                           "fill_blocks_per_s": chains * CHAIN / fill_s, "lookups": dict(zip(names, phases)),
                           "stalls": stalled, "store": stores, "load": loaded, "eviction": evicted,
                           "engines_saving": engines,
                           "rss_mib": {"filled": rss, "after_dry_runs": rss_stalls[0], "children": rss_stalls[2], "end": rss_after[0],
                                       "restarted": rss_restart},
                           "blocks_indexed": {"after_dry_runs": rss_stalls[1], "end": rss_after[1]},
                           "start_to_ready_s": start_s, "directory_src": str(args.directory_src)})


if __name__ == "__main__":
    main()
