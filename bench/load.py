"""Load test: engine processes replay a request trace through the real stack, side by side.

    python bench/load.py (--trace PATH | --synthetic chat|rag|mixed) [--requests 2000]
                         [--engines 1,4] [--replicas 1,3] [--database sqlite|postgresql]
                         [--commits relaxed,durable] [--fsync] [--capacity 0.05] [--json bench/out/load.json]

A directory and one worker run as processes on loopback (SQLite, or a throw-away PostgreSQL
cluster; the DRAM tier sized to `--capacity` of the trace's distinct blocks, LRU eviction,
adaptive admission). With R > 1 directory replicas (PostgreSQL; a fresh database per run) engine
i lists the replicas starting from replica i mod R, so lookups spread over them. For each engine
count K, K engine processes take every K-th request of the trace and, per request, look up its
prefix, load the hit (checking every loaded block's bytes), and save the rest. Block i of a
request is 16 tokens that all carry the trace's hash id, so equal ids are equal prefixes.

Reported per K: requests/s; lookup, load-prepare and save-prepare latency (p50/p99); the prefix
hit ratio realised, beside the policy simulator's on the same trace and capacity (the simulator
replays the requests in order; K engines interleave them); errors and wrong bytes (must be 0);
and the directory's (each replica's) and the worker's CPU seconds per 1,000 requests, lookups and
stored blocks, so that scaling can be read from cost on a machine with few cores.

On PostgreSQL, `--commits relaxed,durable` runs each row with the directory's relaxed commits on
(a save's commit does not wait for the WAL flush) and off (the default, as the directory's), and `--fsync` has the
throw-away cluster flush its WAL to disk as a production database does (the test clusters do not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, cpu_s, local_stack, machine, print_table, write_json

from hit_ratio import load_trace, simulate  # noqa: E402
from tests.helpers import PostgresCluster  # noqa: E402
from kvstore.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION, make_admission, make_eviction  # noqa: E402

BLOCK_TOKENS, HEAD_DIM = 16, 64
BLOCK_BYTES = 2 * BLOCK_TOKENS * HEAD_DIM * 2  # one layer, one KV head, float16: K and V, one 4 KiB page
PAGE = 4096


def namespace():
    from kvstore.connector import Namespace

    return Namespace(model_id="bench-load", num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, dtype="float16",
                     block_tokens=BLOCK_TOKENS)


def engine(args) -> None:
    """One engine process: its share of the requests, timed; results as JSON to --out."""
    import torch

    from kvstore.connector import KVStoreClient

    requests = json.loads(Path(args.requests_file).read_text())[args.index::args.of]
    out = {"lookup_s": [], "load_prepare_s": [], "save_prepare_s": [], "save_s": [], "requests": 0, "blocks": 0,
           "hit_blocks": 0, "loaded_blocks": 0, "stored_blocks": 0, "errors": 0, "wrong_blocks": 0}
    longest = max(len(r) for r in requests) * BLOCK_BYTES
    with KVStoreClient(args.url, namespace(), staging_bytes=max(longest, 1 << 20)) as client:
        for ids in requests:
            tokens = [i for i in ids for _ in range(BLOCK_TOKENS)]
            value = torch.tensor([i % 1024 for i in ids], dtype=torch.float16).repeat_interleave(BLOCK_TOKENS)
            kv = [(value.view(1, -1, 1).expand(1, -1, HEAD_DIM).contiguous(),) * 2]
            try:
                t0 = time.perf_counter()
                hit = client.lookup(tokens) // BLOCK_TOKENS
                out["lookup_s"].append(time.perf_counter() - t0)
                if hit:
                    loaded, n = client.load(tokens)
                    out["load_prepare_s"].append(client.last_timings.get("prepare", 0.0))
                    got = n // BLOCK_TOKENS
                    out["loaded_blocks"] += got
                    for k, v in loaded:
                        expected = value[:n].view(1, -1, 1)
                        out["wrong_blocks"] += int((~((k == expected) & (v == expected)).all(dim=2)[0]
                                                    .view(got, BLOCK_TOKENS).all(dim=1)).sum())
                t0 = time.perf_counter()
                held = client.save(tokens, kv) // BLOCK_TOKENS
                out["save_s"].append(time.perf_counter() - t0)
                out["save_prepare_s"].append(client.last_timings.get("prepare", 0.0))
                out["stored_blocks"] += max(0, held - hit)
                out["hit_blocks"] += hit
            except Exception as exc:  # noqa: BLE001 (counted: the bench reports errors, it does not stop)
                out["errors"] += 1
                print(f"request failed: {exc}", file=sys.stderr)
            out["requests"] += 1
            out["blocks"] += len(ids)
    Path(args.out).write_text(json.dumps(out))


def run(requests: list[list[int]], engines: int, capacity_blocks: int, tmp: Path, replicas: int = 1,
        database_url: str | None = None, commits: str = "durable") -> dict:
    requests_file = tmp / "requests.json"
    requests_file.write_text(json.dumps(requests))
    pids: dict[str, int] = {}
    dram = f"{max(1 << 20, capacity_blocks * PAGE)}"
    with local_stack(dram, page_bytes=str(PAGE), pids=pids, database_url=database_url, replicas=replicas,
                     directory_args=("--eviction", "lru", "--admission", "adaptive",
                                     "--relaxed-commits" if commits == "relaxed" else "--no-relaxed-commits")) as urls:
        before = {name: cpu_s(pid) for name, pid in pids.items()}
        ring = urls.split(",")
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "engine", "--url",
                                   ",".join(ring[i % replicas:] + ring[:i % replicas]), "--requests-file",
                                   str(requests_file), "--index", str(i), "--of", str(engines), "--out",
                                   str(tmp / f"engine-{i}.json")], cwd=REPO) for i in range(engines)]
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - t0
        spent = {name: cpu_s(pid) - before[name] for name, pid in pids.items()}
    results = [json.loads((tmp / f"engine-{i}.json").read_text()) for i in range(engines) if codes[i] == 0]
    total = {key: sum(r[key] for r in results) for key in ("requests", "blocks", "hit_blocks", "loaded_blocks",
                                                          "stored_blocks", "errors", "wrong_blocks")}
    total["errors"] += sum(code != 0 for code in codes)  # an engine that died counts its whole share

    def pct(key: str, q: float) -> float:
        values = [x for r in results for x in r[key]]
        return float(np.percentile(values, q)) * 1e3 if values else 0.0

    spent["directory"] = sum(v for k, v in spent.items() if k.startswith("directory"))  # all replicas
    per = {f"{name}_cpu_s_per_1k": {what: spent[name] / max(1, total[count]) * 1000
                                    for what, count in (("requests", "requests"), ("lookups", "requests"),
                                                        ("stored_blocks", "stored_blocks"))}
           for name in spent}
    return {"replicas": replicas, "database": "postgresql" if database_url else "sqlite",
            "commits": commits if database_url else "-", "engines": engines,
            "wall_s": wall, "requests_per_s": total["requests"] / wall, **total,
            "prefix_hit_ratio": total["hit_blocks"] / max(1, total["blocks"]),
            "lookup_ms": {"p50": pct("lookup_s", 50), "p99": pct("lookup_s", 99)},
            "load_prepare_ms": {"p50": pct("load_prepare_s", 50), "p99": pct("load_prepare_s", 99)},
            "save_prepare_ms": {"p50": pct("save_prepare_s", 50), "p99": pct("save_prepare_s", 99)},
            "save_ms": {"p50": pct("save_s", 50), "p99": pct("save_s", 99)},
            "cpu_s": spent, **per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="JSON lines with hash_ids, e.g. Mooncake's conversation trace")
    source.add_argument("--synthetic", choices=["chat", "rag", "mixed"], help="a trace from bench/synth_trace.py")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--engines", default="1,4")
    parser.add_argument("--replicas", default="1", help="directory replicas, e.g. 1,3 (more than 1: PostgreSQL)")
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite",
                        help="the directory's database; postgresql starts a throw-away cluster")
    parser.add_argument("--commits", default="durable", help="PostgreSQL: relaxed, durable or both (relaxed,durable)")
    parser.add_argument("--fsync", action="store_true", help="the PostgreSQL cluster flushes its WAL to disk")
    parser.add_argument("--capacity", type=float, default=0.05, help="DRAM tier as a fraction of distinct blocks")
    parser.add_argument("--json", default="bench/out/load.json")
    args = parser.parse_args()
    commits = args.commits.split(",")
    if not set(commits) <= {"relaxed", "durable"}:
        parser.error("--commits takes relaxed, durable or both")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-load-") as tmp:
        if args.synthetic:
            trace = Path(tmp) / "synthetic.jsonl"
            subprocess.run([sys.executable, str(REPO / "bench/synth_trace.py"), "--kind", args.synthetic,
                            "--requests", str(args.requests), "--seed", "1", "--out", str(trace)], check=True)
            source = f"synthetic {args.synthetic}"
        else:
            trace, source = Path(args.trace), Path(args.trace).name
        requests = load_trace(str(trace))[0][:args.requests]
        distinct = len({i for r in requests for i in r})
        capacity = max(1, int(distinct * args.capacity))
        simulated = simulate(make_eviction(DEFAULT_EVICTION, capacity), requests, capacity,
                             make_admission(DEFAULT_ADMISSION, capacity))  # what the directory runs
        counts = [int(r) for r in args.replicas.split(",")]
        postgres = args.database == "postgresql" or max(counts) > 1
        cluster = PostgresCluster("-c fsync=on" if args.fsync else "").start() if postgres else None
        try:
            rows = [run(requests, int(k), capacity, Path(tmp), r, cluster.create_database() if cluster else None, c)
                    for r in counts for k in args.engines.split(",") for c in (commits if cluster else ["-"])]
        finally:
            if cluster is not None:
                cluster.stop()
    print(f"{source}: {len(requests)} requests, {distinct} distinct blocks, DRAM tier {capacity} blocks "
          f"({args.capacity:.0%}); simulator's prefix hit ratio {simulated['prefix_hit_ratio']:.3f}")
    print_table(["database", "commits", "replicas", "engines", "req/s", "lookup p50/p99 ms", "load prep p50/p99 ms",
                 "save prep p50/p99 ms", "save p50/p99 ms",
                 "hit ratio", "errors", "wrong", "directory CPU s/1k req", "worker CPU s/1k req",
                 "directory CPU s/1k stored", "per replica CPU s/1k req"],
                [[r["database"], r["commits"], r["replicas"], r["engines"], r["requests_per_s"],
                  f"{r['lookup_ms']['p50']:.2f}/{r['lookup_ms']['p99']:.2f}",
                  f"{r['load_prepare_ms']['p50']:.2f}/{r['load_prepare_ms']['p99']:.2f}",
                  f"{r['save_prepare_ms']['p50']:.2f}/{r['save_prepare_ms']['p99']:.2f}",
                  f"{r['save_ms']['p50']:.2f}/{r['save_ms']['p99']:.2f}", r["prefix_hit_ratio"],
                  r["errors"], r["wrong_blocks"], r["directory_cpu_s_per_1k"]["requests"],
                  r["worker_cpu_s_per_1k"]["requests"], r["directory_cpu_s_per_1k"]["stored_blocks"],
                  "/".join(f"{r[f'directory-{i}_cpu_s_per_1k']['requests']:.2f}" for i in range(r["replicas"]))
                  if r["replicas"] > 1 else "-"]
                 for r in rows])
    write_json(args.json, {"benchmark": "load", "machine": machine(), "trace": source, "fsync": args.fsync,
                           "requests": len(requests),
                           "distinct_blocks": distinct, "capacity_blocks": capacity,
                           "simulated_prefix_hit_ratio": simulated["prefix_hit_ratio"], "runs": rows})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        parser = argparse.ArgumentParser()
        parser.add_argument("mode")
        for flag in ("--url", "--requests-file", "--out"):
            parser.add_argument(flag, required=True)
        parser.add_argument("--index", type=int, required=True)
        parser.add_argument("--of", type=int, required=True)
        engine(parser.parse_args())
    else:
        main()
