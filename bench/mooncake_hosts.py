"""Mooncake Store's side of `bench/hosts.py`: processes it starts in the namespaces standing for
hosts, run with .venv-mooncake's Python (numpy and mooncake only; no kvstore import).

    python bench/mooncake_hosts.py segment --host W1 --master DIR:PORT --bytes N --ready FILE
        # w1: mounts N bytes of memory as the store's only segment, until killed
    python bench/mooncake_hosts.py client --host E1 --master DIR:PORT --block B --bytes N --repeats R
        # e1: mounts none; puts N bytes of B-byte objects (they land in w1's segment), then gets them
        # R times into a registered buffer, each checked byte for byte; prints one JSON line per get

Protocol `tcp`, metadata by P2P handshake, as in `bench/vs_mooncake.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def store(host: str, master: str, segment_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    if s.setup(host, "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master) != 0:
        sys.exit("Mooncake store setup failed")
    return s


def segment(args) -> None:
    mounted = store(args.host, args.master, args.bytes)  # dropping it would unmount the segment
    Path(args.ready).write_text("ready")
    time.sleep(24 * 3600)
    del mounted


def client(args) -> None:
    s = store(args.host, args.master, 0)
    n = args.bytes // args.block
    src = np.random.default_rng(1).integers(0, 255, n * args.block, dtype=np.uint8)
    dst = np.zeros_like(src)
    for array in (src, dst):
        if s.register_buffer(array.ctypes.data, array.nbytes) != 0:
            sys.exit("Mooncake register_buffer failed")
    keys = [f"hosts-{i}" for i in range(n)]
    codes = s.batch_put_from(keys, [src.ctypes.data + i * args.block for i in range(n)], [args.block] * n)
    assert all(c == 0 for c in codes), f"put failed: {sorted(set(codes))[:5]}"
    for _ in range(args.repeats):
        dst[:] = 0
        t0 = time.perf_counter()
        got = s.batch_get_into(keys, [dst.ctypes.data + i * args.block for i in range(n)], [args.block] * n)
        seconds = time.perf_counter() - t0
        assert all(g == args.block for g in got), f"get returned short: {sorted(set(got))[:5]}"
        assert np.array_equal(src, dst), "get returned other bytes than were put"
        print(json.dumps({"s": seconds, "bytes": n * args.block}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["segment", "client"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--block", type=int, default=4 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ready")
    args = parser.parse_args()
    (segment if args.role == "segment" else client)(args)


if __name__ == "__main__":
    main()
