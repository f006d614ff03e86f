"""Tier moves through the store vs the raw paths, side by side in one run.

    python bench/tiers.py [--sizes 1MiB,4MiB] [--batch-bytes 32MiB] [--long-bytes 256MiB] [--repeats 3]
                          [--nvme-direct auto] [--json OUT]

NVMe: the store's demotion (DRAM -> NVMe, `POST /v1/admin/evict`: directory plan,
worker checksum + NIXL POSIX WRITE + manifest) and promotion (NVMe -> DRAM inside
`prepare_load`) vs raw NIXL POSIX WRITE/READ of the same sizes between a
registered buffer and a pre-allocated file in the same directory, from this
process, for both POSIX queues (aio, io_uring), and the aio write followed by an
fdatasync of the file (the store syncs slab data before its manifest line); the
same through a file opened with O_DIRECT (aio), which bypasses the page cache.
A long demotion (`--long-bytes`, one evict of that many bytes: one round of the directory's, one
worker request, up to 256 blocks) against one raw O_DIRECT request of the same bytes + fdatasync;
`--long-bytes 0` leaves it out.
S3 (a local moto_server, which is pure Python and the bottleneck): demotion
NVMe -> S3 and promotion S3 -> DRAM vs raw NIXL OBJ (one request, all objects)
and boto3 (one object at a time) with the same object sizes.
The directory's share of the moves is the CPU time of its process over the
moves' wall time, summed over the repeats (it is otherwise idle here; the
kernel counts CPU time in 10 ms ticks, so one move alone is too short to read).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, cpu_s, local_stack, machine, median, print_table, raw_xfer, timed, write_json  # noqa: E402

from kvstore.connector import KVStoreClient  # noqa: E402
from kvstore.core import specs  # noqa: E402
from kvstore.core.memory import HostBuffer  # noqa: E402
from kvstore.core.sizes import format_size, parse_size  # noqa: E402
from kvstore.transfer import Agent  # noqa: E402
from datapath import namespace_for  # noqa: E402
from tests.helpers import MotoServer  # noqa: E402


def raw_posix(tmp: Path, queue: str, block: int, n: int, repeats: int, direct: bool = False) -> dict:
    agent = Agent(f"bench-posix-{queue}", {"POSIX": {"use_uring": "true"} if queue == "uring" else {"use_aio": "true"}},
                  progress_thread=False)
    buf = HostBuffer(block * n)
    buf.array[:] = 7
    agent.register_dram(buf.addr, buf.nbytes)
    path = tmp / f"raw-{queue}{'-direct' if direct else ''}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    os.posix_fallocate(fd, 0, block * n)
    agent.register_file(fd, block * n, str(path))
    local = np.array([(buf.addr + i * block, block) for i in range(n)], dtype=np.uint64)
    remote = np.array([(i * block, block, fd) for i in range(n)], dtype=np.uint64)
    w = [raw_xfer(agent, "WRITE", local, remote, agent.name, "FILE") for _ in range(repeats)]
    ws = [raw_xfer(agent, "WRITE", local, remote, agent.name, "FILE") + timed(lambda: os.fdatasync(fd))
          for _ in range(repeats)]
    r = [raw_xfer(agent, "READ", local, remote, agent.name, "FILE") for _ in range(repeats)]
    agent.close()
    os.close(fd)
    return {"write_gbps": block * n / median(w) / 1e9, "write_sync_gbps": block * n / median(ws) / 1e9,
            "read_gbps": block * n / median(r) / 1e9}


def store_moves(url: str, block: int, n: int, repeats: int, lower: str, directory_pid: int) -> dict:
    """Save n blocks, demote them (to NVMe, or on to S3), then time promotion back via prepare_load.
    The directory's share of the moves: the CPU time its process spent over their wall time."""
    ns = namespace_for(block)
    down, up, cpu_down, cpu_up = [], [], [], []
    with KVStoreClient(url, ns, staging_bytes=block) as client:
        src = HostBuffer(block * n)
        src.array[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
        client.register_buffer(src.array)
        views = [src.view(i * block, block) for i in range(n)]
        for _ in range(repeats):
            hashes = [os.urandom(16) for _ in range(n)]
            assert client.save_blocks(hashes, views) == n
            ask = dict(namespace_id=ns.namespace_id, limit=n)
            tiers = ("dram",) if lower == "nvme" else ("dram", "nvme")
            for tier in tiers:  # the last move is the one measured
                cpu0 = cpu_s(directory_pid)
                seconds = timed(lambda: client.directory.evict_tier(specs.EvictRequest(tier=tier, **ask)))
                cpu = cpu_s(directory_pid) - cpu0
            by_tier = client.directory.lookup(ns.namespace_id, [h.hex() for h in hashes]).by_tier
            assert by_tier == {lower: n}, by_tier
            down.append(seconds)
            cpu_down.append(cpu)
            body = specs.PrepareLoad(namespace_id=ns.namespace_id, hashes=[h.hex() for h in hashes])
            cpu0, t0 = cpu_s(directory_pid), time.perf_counter()
            prepared = client.directory.prepare_load(body)
            up.append(time.perf_counter() - t0)
            cpu_up.append(cpu_s(directory_pid) - cpu0)
            assert len(prepared.blocks) == n and prepared.blocks[0].location.tier == "dram"
            client.directory.complete_load(specs.CompleteLoad(token=prepared.token))
            client.directory.evict(ns.namespace_id)
    return {"demote_gbps": block * n / median(down) / 1e9, "promote_gbps": block * n / median(up) / 1e9,
            "directory_share_demote": sum(cpu_down) / sum(down), "directory_share_promote": sum(cpu_up) / sum(up)}


def raw_s3(s3: MotoServer, block: int, n: int, repeats: int) -> dict:
    agent = Agent("bench-obj", {"OBJ": {"bucket": "bench", "endpoint_override": s3.url, "scheme": "http",
                                        "access_key": "testing", "secret_key": "testing", "region": "us-east-1",
                                        "req_checksum": "required"}}, progress_thread=False)
    buf = HostBuffer(block * n)
    buf.array[:] = 5
    agent.register_dram(buf.addr, buf.nbytes)
    for i in range(n):
        agent.register_object(i + 1, block, f"raw/{block}/{i}")
    local = np.array([(buf.addr + i * block, block) for i in range(n)], dtype=np.uint64)
    remote = np.array([(0, block, i + 1) for i in range(n)], dtype=np.uint64)
    w = [raw_xfer(agent, "WRITE", local, remote, agent.name, "OBJ") for _ in range(repeats)]
    r = [raw_xfer(agent, "READ", local, remote, agent.name, "OBJ") for _ in range(repeats)]
    agent.close()
    client, data = s3.client(), bytes(block)
    bw = [timed(lambda: [client.put_object(Bucket="bench", Key=f"boto/{i}", Body=data) for i in range(n)])
          for _ in range(repeats)]
    br = [timed(lambda: [client.get_object(Bucket="bench", Key=f"boto/{i}")["Body"].read() for i in range(n)])
          for _ in range(repeats)]
    total = block * n
    return {"obj_write_gbps": total / median(w) / 1e9, "obj_read_gbps": total / median(r) / 1e9,
            "boto3_write_gbps": total / median(bw) / 1e9, "boto3_read_gbps": total / median(br) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1MiB,4MiB")
    parser.add_argument("--batch-bytes", default="32MiB")
    parser.add_argument("--long-bytes", default="256MiB", help="one long demotion of this many bytes (0: none)")
    parser.add_argument("--s3-batch-bytes", default="8MiB", help="moto is slow: fewer bytes for S3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nvme-direct", default="auto", choices=("auto", "on", "off"),
                        help="the worker's NVMe slabs with O_DIRECT (auto, its default) or through the page cache")
    parser.add_argument("--json", default="bench/out/tiers.json")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch, s3_batch, long = parse_size(args.batch_bytes), parse_size(args.s3_batch_bytes), parse_size(args.long_bytes)
    tier_bytes = format_size(max(4 * batch, 2 * long)).replace(" ", "")
    for key, value in MotoServer.CREDENTIALS.items():
        os.environ[key] = value
    results = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=REPO / "var" if (REPO / "var").is_dir()
                                     else None) as tmp:
        tmp = Path(tmp)
        s3 = MotoServer(tmp / "moto.log").start()
        s3.client().create_bucket(Bucket="bench")
        stack_args = ("--nvme-bytes", tier_bytes, "--nvme-dir", str(tmp / "nvme"),
                      "--s3-bucket", "bench", "--s3-endpoint", s3.url, "--bounce-bytes", "64MiB",
                      *(("--nvme-direct", args.nvme_direct) if args.nvme_direct != "auto" else ()))
        try:
            pids: dict[str, int] = {}
            with local_stack(dram_bytes=tier_bytes, worker_args=stack_args,
                             pids=pids) as url:
                for size in sizes:
                    print(f"block {format_size(size)} ...", flush=True)
                    n, n3 = max(1, batch // size), max(1, s3_batch // size)
                    row = {"block_bytes": size, "blocks_nvme": n, "blocks_s3": n3,
                           "nvme_store": store_moves(url, size, n, args.repeats, "nvme", pids["directory"]),
                           "posix_aio": raw_posix(tmp, "aio", size, n, args.repeats),
                           "posix_uring": raw_posix(tmp, "uring", size, n, args.repeats),
                           "posix_direct": raw_posix(tmp, "aio", size, n, args.repeats, direct=True),
                           "s3_store": store_moves(url, size, n3, args.repeats, "s3", pids["directory"]),
                           "s3_raw": raw_s3(s3, size, n3, args.repeats)}
                    if long:
                        nl = max(1, long // size)
                        row.update(blocks_long=nl, long_store=store_moves(url, size, nl, args.repeats, "nvme",
                                                                           pids["directory"]),
                                   long_direct=raw_posix(tmp, "aio", size, nl, args.repeats, direct=True))
                    results.append(row)
        finally:
            s3.stop()
    print()
    print_table(["block", "demote->NVMe", "raw POSIX W aio/uring", "raw W+fdatasync", "O_DIRECT W+fds/R",
                 "promote<-NVMe", "raw POSIX R aio/uring", "demote/raw W+fds", "demote/O_DIRECT W+fds",
                 "promote/O_DIRECT R", "promote/raw R", "directory CPU share demote/promote"],
                [[format_size(r["block_bytes"]), r["nvme_store"]["demote_gbps"],
                  f'{r["posix_aio"]["write_gbps"]:.2f}/{r["posix_uring"]["write_gbps"]:.2f}',
                  r["posix_aio"]["write_sync_gbps"],
                  f'{r["posix_direct"]["write_sync_gbps"]:.2f}/{r["posix_direct"]["read_gbps"]:.2f}',
                  r["nvme_store"]["promote_gbps"],
                  f'{r["posix_aio"]["read_gbps"]:.2f}/{r["posix_uring"]["read_gbps"]:.2f}',
                  r["nvme_store"]["demote_gbps"] / r["posix_aio"]["write_sync_gbps"],
                  r["nvme_store"]["demote_gbps"] / r["posix_direct"]["write_sync_gbps"],
                  r["nvme_store"]["promote_gbps"] / r["posix_direct"]["read_gbps"],
                  r["nvme_store"]["promote_gbps"] / r["posix_aio"]["read_gbps"],
                  f'{r["nvme_store"]["directory_share_demote"]:.0%}/{r["nvme_store"]["directory_share_promote"]:.0%}']
                 for r in results])
    if long:
        print()
        print_table(["block", "long demote->NVMe", "raw O_DIRECT W+fds", "demote/raw", "directory CPU share"],
                    [[format_size(r["block_bytes"]), r["long_store"]["demote_gbps"],
                      r["long_direct"]["write_sync_gbps"],
                      r["long_store"]["demote_gbps"] / r["long_direct"]["write_sync_gbps"],
                      f'{r["long_store"]["directory_share_demote"]:.0%}'] for r in results])
        print(f"(one demotion of {format_size(long)} against one raw O_DIRECT request of the same bytes)")
    print()
    print_table(["block", "NVMe->S3", "raw OBJ W", "boto3 W", "S3->DRAM", "raw OBJ R", "boto3 R",
                 "demote/OBJ W", "promote/OBJ R", "directory CPU share demote/promote"],
                [[format_size(r["block_bytes"]), r["s3_store"]["demote_gbps"], r["s3_raw"]["obj_write_gbps"],
                  r["s3_raw"]["boto3_write_gbps"], r["s3_store"]["promote_gbps"], r["s3_raw"]["obj_read_gbps"],
                  r["s3_raw"]["boto3_read_gbps"], r["s3_store"]["demote_gbps"] / r["s3_raw"]["obj_write_gbps"],
                  r["s3_store"]["promote_gbps"] / r["s3_raw"]["obj_read_gbps"],
                  f'{r["s3_store"]["directory_share_demote"]:.0%}/{r["s3_store"]["directory_share_promote"]:.0%}']
                 for r in results])
    print(f"(GB/s, medians; the worker's slabs: --nvme-direct {args.nvme_direct}; raw paths with the aio queue, the\n"
          " worker's default: through the page cache, or O_DIRECT (bypassing it) as the worker's slabs are by\n"
          " default; W+fdatasync: the write and an fdatasync of the file, as the store syncs slab data before its\n"
          " manifest line; directory CPU share: the directory process's CPU time over the moves' wall time, all\n"
          " repeats)")
    write_json(args.json, {"benchmark": "tiers", "machine": machine(), "batch_bytes": batch,
                           "nvme_direct": args.nvme_direct, "long_bytes": long,
                           "s3_batch_bytes": s3_batch, "repeats": args.repeats, "results": results})
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
