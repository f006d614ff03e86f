"""A load across hosts against the link it crosses: network namespaces joined by a bridge (the
tests' `tests/netns.Hosts`), the engine host's link shaped to `--rate`, UCX over TCP.

    python bench/hosts.py [--rate 10gbit] [--block 4MiB] [--bytes 256MiB] [--repeats 3] [--json OUT]

Hosts: `dir` (the directory), `w1` (a worker), `e1` (the engine). The reference is raw TCP between
the same two namespaces: one connection from w1 to e1 carrying `--bytes` (iperf-style). The store's
load is `KVStoreClient.load_blocks` of `--bytes` of blocks that the engine saved to w1 (prepare,
the bytes, checksums, complete), two ways, one after the other in each repeat (which goes first
alternates): pulled (the engine READs them, `load_push="off"`) and pushed (w1 WRITEs them into the
engine's memory, "on"); NIXL UCX over TCP both. All cross e1's shaped link in the same
direction. Medians over `--repeats`; the ratios are of medians from one run.

Mooncake Store beside it, when .venv-mooncake exists (`make setup-mooncake`; `--mooncake off`
skips it): its master in `dir`, a store process mounting the only segment in `w1`, a client in
`e1` that puts `--bytes` of `--block` objects and gets them `--repeats` times (protocol `tcp`;
`bench/mooncake_hosts.py`), over the same shaped link.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, print_table, write_json  # noqa: E402

from kvstore.core.sizes import format_size, parse_size  # noqa: E402
from tests.helpers import kvstore_cmd, wait_http, wait_until  # noqa: E402
from tests.netns import Hosts  # noqa: E402

TCP = {"UCX_TLS": "tcp"}
PORT, RAW_PORT, MOONCAKE_PORT = 8700, 9100, 50051
MOONCAKE = Path(__file__).resolve().parents[1] / ".venv-mooncake"


def raw_receiver(host: str, nbytes: int, repeats: int) -> None:
    """e1: accept `repeats` connections, each carrying `nbytes`; print the seconds of each."""
    server = socket.create_server((host, RAW_PORT))
    print("ready", flush=True)
    buffer = bytearray(4 << 20)
    for _ in range(repeats):
        conn, _ = server.accept()
        t0, got = time.perf_counter(), 0
        while got < nbytes:
            n = conn.recv_into(buffer)
            if not n:
                break
            got += n
        print(json.dumps({"s": time.perf_counter() - t0, "bytes": got}), flush=True)
        conn.close()


def raw_sender(host: str, nbytes: int, repeats: int) -> None:
    """w1: send `nbytes` over a new connection, `repeats` times."""
    chunk = bytes(4 << 20)
    for _ in range(repeats):
        for _ in range(100):
            try:
                conn = socket.create_connection((host, RAW_PORT))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        sent = 0
        while sent < nbytes:
            conn.sendall(chunk[: min(len(chunk), nbytes - sent)])
            sent += min(len(chunk), nbytes - sent)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        conn.close()
        time.sleep(0.2)


def store_engine(url: str, block: int, nbytes: int, repeats: int) -> None:
    """e1: save `nbytes` of blocks, then load them `repeats` times; print the seconds of each load."""
    import numpy as np

    from kvstore.connector import KVStoreClient, Namespace
    from kvstore.core.keys import block_hashes

    ns = Namespace(model_id="bench-hosts", num_layers=1, num_kv_heads=8, head_dim=128, dtype="float32",
                   block_tokens=block // (2 * 8 * 128 * 4))
    n = nbytes // ns.block_nbytes
    clients = {mode: KVStoreClient(url, ns, staging_bytes=n * ns.block_nbytes, same_host="off", load_push=mode)
               for mode in ("off", "on")}
    try:
        hashes = block_hashes(ns, list(range(n * ns.block_tokens)))
        views = clients["off"]._staging_views(n)
        for k, view in enumerate(views):
            view[:] = np.random.default_rng(k).integers(0, 255, view.size, dtype=np.uint8)
        assert clients["off"].save_blocks(hashes, views) == n, clients["off"].last_refused
        for repeat in range(repeats):
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):  # neither always goes first
                client = clients[mode]
                views, before = client._staging_views(n), client.pusher.pushed
                t0 = time.perf_counter()
                loaded = client.load_blocks(hashes, views)
                print(json.dumps({"push": mode, "s": time.perf_counter() - t0, "blocks": loaded,
                                  "bytes": loaded * ns.block_nbytes, "pushed": client.pusher.pushed - before,
                                  "phases": client.last_timings}), flush=True)
    finally:
        for client in clients.values():
            client.close()


def results(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> list[dict]:
    assert proc.wait(timeout=timeout_s) == 0, log.read_text()[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def run(args) -> dict:
    block, nbytes = parse_size(args.block), parse_size(args.bytes)
    with tempfile.TemporaryDirectory(prefix="kvstore-hosts-") as tmp_name, \
            Hosts(Path(tmp_name), ["dir", "w1", "e1"]) as hosts:
        tmp = Path(tmp_name)
        me = [sys.executable, str(Path(__file__).resolve())]
        hosts.shape("e1", args.rate)
        receiver = hosts.spawn("e1", [*me, "--role", "raw-receiver", "--bytes", args.bytes, "--repeats",
                                      str(args.repeats)], tmp / "raw-receiver.log")
        wait_until(lambda: "ready" in (tmp / "raw-receiver.log").read_text(), 30, "the raw receiver")
        sender = hosts.spawn("w1", [*me, "--role", "raw-sender", "--url", hosts.addr("e1"), "--bytes", args.bytes,
                                    "--repeats", str(args.repeats)], tmp / "raw-sender.log")
        raw = results(receiver, tmp / "raw-receiver.log")
        sender.wait(timeout=60)
        url = f"http://{hosts.addr('dir')}:{PORT}"
        directory = hosts.spawn("dir", kvstore_cmd("directory", "serve", "--insecure-no-auth", "--host",
                                                   hosts.addr("dir"), "--port", str(PORT), "--data-dir",
                                                   str(tmp / "var")), tmp / "directory.log")
        wait_http(url + "/readyz?workers=0", proc=directory)
        hosts.spawn("w1", kvstore_cmd("worker", "serve", "--directory-url", url, "--name", "w1", "--host",
                                      hosts.addr("w1"), "--dram-bytes", format_size(nbytes + (64 << 20)),
                                      "--page-bytes", "64KiB", "--arena-dir", str(hosts.folder("w1") / "arenas")),
                    tmp / "worker.log", TCP)
        wait_http(url + "/readyz?workers=1")
        engine = hosts.spawn("e1", [*me, "--role", "store-engine", "--url", url, "--block", args.block, "--bytes",
                                    args.bytes, "--repeats", str(args.repeats)], tmp / "engine.log", TCP)
        store = results(engine, tmp / "engine.log")
        mooncake = mooncake_gets(hosts, tmp, args) if args.mooncake == "auto" and MOONCAKE.exists() else []
    raw_gbps = median([r["bytes"] / r["s"] / 1e9 for r in raw])
    pulled = median([r["bytes"] / r["s"] / 1e9 for r in store if r["push"] == "off"])
    pushed = median([r["bytes"] / r["s"] / 1e9 for r in store if r["push"] == "on"])
    assert all(r["pushed"] == r["blocks"] for r in store if r["push"] == "on"), "a pushed load read blocks instead"
    out = {"machine": machine(), "rate": args.rate, "block": args.block, "bytes": args.bytes,
           "raw_tcp_GBps": raw_gbps, "pulled_load_GBps": pulled, "pushed_load_GBps": pushed,
           "pulled_vs_raw": pulled / raw_gbps, "pushed_vs_raw": pushed / raw_gbps, "raw": raw, "store": store,
           "mooncake": mooncake}
    if mooncake:
        out["mooncake_get_GBps"] = median([r["bytes"] / r["s"] / 1e9 for r in mooncake])
        out["pushed_vs_mooncake"] = pushed / out["mooncake_get_GBps"]
        out["pulled_vs_mooncake"] = pulled / out["mooncake_get_GBps"]
    return out


def mooncake_gets(hosts: Hosts, tmp: Path, args) -> list[dict]:
    """Mooncake's master in dir, its segment in w1, a client in e1: the client's gets."""
    python, script = str(MOONCAKE / "bin" / "python"), str(Path(__file__).resolve().parent / "mooncake_hosts.py")
    master = f"{hosts.addr('dir')}:{MOONCAKE_PORT}"
    hosts.spawn("dir", [str(MOONCAKE / "bin" / "mooncake_master"), "--rpc_port", str(MOONCAKE_PORT), "--rpc_address",
                        hosts.addr("dir"), "--metrics_port", str(MOONCAKE_PORT + 1),
                        "--enable_metric_reporting=false"], tmp / "mooncake-master.log")
    ready = tmp / "mooncake-segment-ready"
    segment = hosts.spawn("w1", [python, script, "segment", "--host", hosts.addr("w1"), "--master", master,
                                 "--bytes", str(parse_size(args.bytes) + (256 << 20)), "--ready", str(ready)],
                          tmp / "mooncake-segment.log")
    wait_until(lambda: ready.exists() or segment.poll() is not None, 60, "Mooncake's segment")
    assert ready.exists(), (tmp / "mooncake-segment.log").read_text()[-3000:]
    client = hosts.spawn("e1", [python, script, "client", "--host", hosts.addr("e1"), "--master", master,
                                "--bytes", str(parse_size(args.bytes)), "--block", str(parse_size(args.block)),
                                "--repeats", str(args.repeats)], tmp / "mooncake-client.log")
    return results(client, tmp / "mooncake-client.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="10gbit", help="tc's rate for the engine host's link")
    parser.add_argument("--block", default="4MiB")
    parser.add_argument("--bytes", default="256MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mooncake", choices=["auto", "off"], default="auto",
                        help="Mooncake Store beside the store, when .venv-mooncake exists")
    parser.add_argument("--json")
    parser.add_argument("--role", choices=["raw-receiver", "raw-sender", "store-engine"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)  # the directory's (store-engine), e1's address (raw-sender)
    args = parser.parse_args()
    if args.role == "raw-receiver":
        return raw_receiver("0.0.0.0", parse_size(args.bytes), args.repeats)
    if args.role == "raw-sender":
        return raw_sender(args.url, parse_size(args.bytes), args.repeats)
    if args.role == "store-engine":
        return store_engine(args.url, parse_size(args.block), parse_size(args.bytes), args.repeats)
    result = run(args)
    print_table(["link", "block", "bytes", "raw TCP GB/s", "pulled GB/s", "pushed GB/s", "pulled ÷ raw",
                 "pushed ÷ raw"],
                [[args.rate, args.block, args.bytes, result["raw_tcp_GBps"], result["pulled_load_GBps"],
                  result["pushed_load_GBps"], result["pulled_vs_raw"], result["pushed_vs_raw"]]])
    if result["mooncake"]:
        print_table(["Mooncake get GB/s", "pushed ÷ Mooncake", "pulled ÷ Mooncake"],
                    [[result["mooncake_get_GBps"], result["pushed_vs_mooncake"], result["pulled_vs_mooncake"]]])
    else:
        print("Mooncake: not run (--mooncake off, or no .venv-mooncake: make setup-mooncake)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
