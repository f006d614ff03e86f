"""What the engine's HTTP client costs a call: the same lookup three ways, side by side.

    python bench/http_client.py [--calls 1000] [--rounds 8] [--json bench/out/http_client.json]

A directory and a worker on loopback (SQLite in a temp dir, no credentials), 128 blocks stored.
This process asks it for the same 128-hash lookup over one keep-alive connection each way, in
turn, `--rounds` times `--calls` lookups: through `JsonHttp` (the client every engine, worker and
CLI uses: the request built from a pydantic model, the answer validated into one), through the
standard library's `http.client` with the same request and answer models, and over a bare socket
(the request as bytes in one send, the answer's bytes read by their Content-Length, nothing
validated): the floor. The table shows the median latency of each round's calls, medians over
rounds, and each client over the bare socket, round by round.
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import sys
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import local_stack, machine, median, print_table, write_json  # noqa: E402

from kvstore.connector import KVStoreClient  # noqa: E402
from kvstore.core import specs  # noqa: E402
from kvstore.core.keys import Namespace  # noqa: E402
from kvstore.core.memory import HostBuffer  # noqa: E402

NS = Namespace(model_id="bench-http", num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)
HASHES = 128


def with_json_http(client, body: specs.LookupRequest):
    return lambda: client.call("POST", "/v1/lookup", body, specs.LookupResult).num_hit_blocks


def with_http_client(port: int, body: specs.LookupRequest):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call() -> int:
        conn.request("POST", "/v1/lookup", body.model_dump_json().encode(), {"content-type": "application/json"})
        response = conn.getresponse()
        return specs.LookupResult.model_validate_json(response.read()).num_hit_blocks
    return call


def with_socket(port: int, body: specs.LookupRequest):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    content = body.model_dump_json().encode()
    request = (f"POST /v1/lookup HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(content)}\r\n\r\n").encode() + content

    def call() -> int:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body_bytes = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body_bytes) < length:
            body_bytes += sock.recv(65536)
        return HASHES if f'"num_hit_blocks":{HASHES}'.encode() in body_bytes.replace(b" ", b"") else -1
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", default="bench/out/http_client.json")
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        sys.exit("error: --calls and --rounds must be at least 1")
    with local_stack(dram_bytes="64MiB") as url, KVStoreClient(url, NS, staging_bytes=NS.block_nbytes) as engine:
        blocks = HostBuffer(HASHES * NS.block_nbytes)
        engine.register_buffer(blocks.array)
        hashes = [os.urandom(16) for _ in range(HASHES)]
        views = [blocks.view(k * NS.block_nbytes, NS.block_nbytes) for k in range(HASHES)]
        assert engine.save_blocks(hashes, views) == HASHES, "the blocks were not stored"
        port = urlsplit(url).port
        body = specs.LookupRequest(namespace_id=engine.namespace_id, hashes=[h.hex() for h in hashes])
        ways = {"JsonHttp": with_json_http(engine.directory, body), "http.client": with_http_client(port, body),
                "bare socket": with_socket(port, body)}
        for call in ways.values():
            for _ in range(200):
                assert call() == HASHES, "the lookup did not find the stored blocks"
        rounds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, call in ways.items():
                times = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                rounds[name].append(median(times) * 1e6)
    floor = rounds["bare socket"]
    result = {"benchmark": "http_client", "machine": machine(), "args": vars(args),
              "median_us": {name: median(r) for name, r in rounds.items()}, "rounds_us": rounds,
              "over_socket": {name: [t / f for t, f in zip(r, floor)] for name, r in rounds.items()}}
    print_table(["client", "lookup µs, median of rounds", "÷ bare socket, per round"],
                [[name, median(r), " ".join(f"{x:.2f}" for x in result["over_socket"][name])]
                 for name, r in rounds.items()])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
