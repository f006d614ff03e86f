"""What credentials cost a lookup: one directory with them and one without, side by side.

    python bench/auth.py [--calls 5000] [--rounds 5] [--baseline REV] [--json bench/out/auth.json]

Both directories run as processes on loopback (SQLite in temp dirs); one is started with
--insecure-no-auth, the other with an engine token made through its API. A client process asks
each in turn for rounds of `--calls` lookups of a 128-hash prefix over one keep-alive
connection; the table shows median latency per round and the ratio with/without. `--baseline REV`
adds a third directory without credentials, run from git revision REV (checked out in a temporary
worktree), to measure what a change to the request path costs, side by side.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, machine, median, print_table, random_hash, write_json

from kvstore.client import DirectoryClient  # noqa: E402
from kvstore.core.credentials import TokenCreate  # noqa: E402
from kvstore.core.keys import Namespace  # noqa: E402
from tests.helpers import free_port, kvstore_cmd, stop, wait_http  # noqa: E402

NS = Namespace(model_id="bench-auth", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)


def lookups(port: int, token: str | None, body: bytes, calls: int) -> float:
    """Median seconds of `calls` lookups over one connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/lookup", body, headers)
        response = conn.getresponse()
        response.read()
        times.append(time.perf_counter() - t0)
        assert response.status == 200, response.status
    conn.close()
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="git revision whose directory (no credentials) runs beside")
    parser.add_argument("--json", default="bench/out/auth.json")
    args = parser.parse_args()
    procs, stacks = [], {}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-auth-") as tmp:
        base = Path(tmp) / "baseline"
        if args.baseline:
            subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(base), args.baseline], cwd=REPO,
                           check=True)
        try:
            for mode in ("open", "tokens") + (("baseline",) if args.baseline else ()):
                port, data = free_port(), Path(tmp) / mode
                flags = ["--admin-token-file", str(data / "admin")] if mode == "tokens" else ["--insecure-no-auth"]
                tree = base if mode == "baseline" else REPO  # `python -m` imports the tree it runs in first
                procs.append(subprocess.Popen(kvstore_cmd("directory", "serve", "--port", str(port), "--data-dir",
                                                          str(data), *flags), cwd=tree,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
                wait_http(f"http://127.0.0.1:{port}/readyz?workers=0", proc=procs[-1])
                admin = DirectoryClient(f"http://127.0.0.1:{port}", token=(data / "admin").read_text().strip()
                                        if mode == "tokens" else None)
                token = admin.create_token(TokenCreate(name="bench", scopes=["engine"], tenants=[""])).token \
                    if mode == "tokens" else None
                namespace_id = DirectoryClient(admin.base_url, token=token).register_namespace(NS)
                body = json.dumps({"namespace_id": namespace_id, "hashes": [random_hash(0, i) for i in range(128)]})
                stacks[mode] = (port, token, body.encode())
            rounds = {mode: [] for mode in stacks}
            for _ in range(args.rounds):
                for mode, (port, token, body) in stacks.items():
                    rounds[mode].append(lookups(port, token, body, args.calls))
        finally:
            for proc in procs:
                stop(proc)
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    p50 = {mode: median(v) * 1e6 for mode, v in rounds.items()}
    print_table(["lookup p50 without credentials (µs)", "with an engine token (µs)", "with/without"],
                [[p50["open"], p50["tokens"], p50["tokens"] / p50["open"]]])
    if args.baseline:
        print_table([f"lookup p50 at {args.baseline} (µs)", "here (µs)", "here/baseline"],
                    [[p50["baseline"], p50["open"], p50["open"] / p50["baseline"]]])
    write_json(args.json, {"benchmark": "auth", "machine": machine(), "calls": args.calls, "rounds": args.rounds,
                           "baseline": args.baseline, "p50_us": p50, "ratio": p50["tokens"] / p50["open"],
                           "rounds_us": {k: [x * 1e6 for x in v] for k, v in rounds.items()}})
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
