"""An event loop's request latency beside Python work on another thread, with and without `pace`.

    python bench/pacing.py [--seconds 4] [--rounds 3] [--json bench/out/pacing.json]

A server in this process answers 100-byte requests on an event loop (uvloop and the GIL switch
interval the directory runs with), each after about 0.1 ms of Python work, calling `pace.served()`
after each as the directory's hot path does; a client process sends them one at a time over
loopback. Beside it: nothing (quiet); a thread computing in Python without pause; the same work in
another process; the same thread in a `pace.tier_sized()` job, its loop run through `pace.paced`
(as the directory's tier-sized work). Each row is the median over `--rounds` of the client's
p50/p99, and its p99 over the quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import sys
import threading
import time

import uvloop
from common import machine, median, print_table, write_json

from kvstore.core import pace
from kvstore.directory.process.app import GIL_SWITCH_S

MODES = ("quiet", "a thread computing", "a process computing", "a thread computing, paced")


def _client(port: int, seconds: float, out) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    latencies, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        conn.sendall(b"x" * 100)
        conn.recv(100)
        latencies.append(time.perf_counter() - began)
    out.put(latencies)


def _compute(stop, paced: bool = False) -> None:
    with pace.tier_sized(paced):
        while not stop.is_set():
            total = 0
            for i in pace.paced(range(10_000)):
                total += i


async def _serve(reader, writer) -> None:
    while data := await reader.read(100):
        total = 0
        for i in range(3_000):  # about 0.1 ms: a lookup's own work, smaller
            total += i
        writer.write(data)
        pace.served()


async def _round(mode: str, seconds: float) -> list[float]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    client = ctx.Process(target=_client, args=(port, seconds, out))
    if mode == MODES[2]:
        ctx.Process(target=_compute, args=(stop,), daemon=True).start()
    elif mode != MODES[0]:
        threading.Thread(target=_compute, args=(stop, mode == MODES[3]), daemon=True).start()
    client.start()
    latencies = await asyncio.get_running_loop().run_in_executor(None, out.get)
    stop.set()
    client.join()
    server.close()
    await server.wait_closed()
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.setswitchinterval(GIL_SWITCH_S)  # as the directory runs
    results = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            xs = uvloop.run(_round(mode, args.seconds))
            results[mode].append({"p50_ms": 1e3 * xs[len(xs) // 2], "p99_ms": 1e3 * xs[int(len(xs) * 0.99)],
                                  "requests": len(xs)})
            time.sleep(0.5)  # the spinner of a process round stops
    rows = []
    quiet = median([r["p99_ms"] for r in results[MODES[0]]])
    for mode, runs in results.items():
        p99 = median([r["p99_ms"] for r in runs])
        rows.append([mode, round(median([r["requests"] for r in runs]) / args.seconds),
                     median([r["p50_ms"] for r in runs]), p99, round(p99 / quiet, 2)])
    print_table(["beside the event loop", "requests/s", "p50 ms", "p99 ms", "p99 ÷ quiet"], rows)
    write_json(args.json, {"machine": machine(), "seconds": args.seconds, "rounds": results,
                           "work_s": pace.WORK_S, "rest_s": pace.REST_S,
                           "switch_interval_s": GIL_SWITCH_S})


if __name__ == "__main__":
    main()
