"""Capacity efficiency: KV bytes held ÷ bytes of the pages holding them, per block size and page size.

    python bench/capacity.py [--pages 64KiB,4KiB] [--json bench/out/capacity.json]

For each page size and each block size, a directory and a worker (64 MiB of DRAM, 64 MiB of NVMe)
as processes; a KVStoreClient saves blocks of that size (real bytes, over NIXL), then the DRAM
tier is evicted down to NVMe. The figures are what `kvstore tiers` reports for each tier (its
`KV/used` column: kv_bytes ÷ block_bytes of the visible replicas).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import local_stack, machine, print_table, write_json

from kvstore.client import DirectoryClient
from kvstore.connector import KVStoreClient
from kvstore.core import specs
from kvstore.core.keys import Namespace
from kvstore.core.sizes import format_size, parse_size

# block sizes from 16 KiB to 8 MiB, as models make them (16 tokens a block unless said)
SHAPES = {
    "16 KiB (1 layer, 2 heads, dim 128, bf16)": dict(num_layers=1, num_kv_heads=2, head_dim=128, dtype="bfloat16"),
    "72 KiB (9 layers, 2 heads, dim 64, bf16)": dict(num_layers=9, num_kv_heads=2, head_dim=64, dtype="bfloat16"),
    "549 KiB (61 layers, 1 head, dim 288, fp8)": dict(num_layers=61, num_kv_heads=1, head_dim=288,
                                                     dtype="float8_e4m3fn"),
    "768 KiB (48 layers, 2 heads, dim 128, bf16)": dict(num_layers=48, num_kv_heads=2, head_dim=128,
                                                       dtype="bfloat16"),
    "8 MiB (64 layers, 8 heads, dim 128, bf16, 32 tokens)": dict(num_layers=64, num_kv_heads=8, head_dim=128,
                                                                dtype="bfloat16", block_tokens=32),
}
STORED_BYTES = 16 << 20  # of KV per block size (at least 4 blocks)


def efficiency(client: DirectoryClient, kind: str) -> float | None:
    tier = next(t for t in client.tiers() if t.kind == kind)
    return round(tier.efficiency, 4) if tier.efficiency is not None else None


def measure(page: str, name: str, shape: dict) -> dict:
    ns = Namespace(model_id=f"capacity-{name.split()[0]}", block_tokens=shape.pop("block_tokens", 16), **shape)
    count = max(4, STORED_BYTES // ns.block_nbytes)
    with tempfile.TemporaryDirectory(prefix="kvstore-capacity-") as tmp:
        with local_stack("64MiB", page, worker_args=("--nvme-bytes", "64MiB", "--nvme-dir", str(Path(tmp) / "nvme"))
                         ) as url:
            directory = DirectoryClient(url)
            memory = np.random.default_rng(1).integers(0, 256, (count, ns.block_nbytes), dtype=np.uint8)
            hashes = [i.to_bytes(16, "big") for i in range(1, count + 1)]
            with KVStoreClient(url, ns, staging_bytes=ns.block_nbytes) as client:
                client.register_buffer(memory)
                stored = client.save_blocks(hashes, list(memory))
            dram = efficiency(directory, "dram")
            directory.evict_tier(specs.EvictRequest(tier="dram", limit=count))
            deadline = time.time() + 60
            while time.time() < deadline and not any(t.kind == "nvme" and t.num_blocks == stored
                                                      for t in directory.tiers()):
                time.sleep(0.2)
            return {"page": page, "block": name, "block_bytes": ns.block_nbytes, "blocks": stored,
                    "dram": dram, "nvme": efficiency(directory, "nvme")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="64KiB,4KiB", help="page sizes to compare")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(page, name, dict(shape)) for page in args.pages.split(",") for name, shape in SHAPES.items()]
    print_table(["page", "block", "blocks", "DRAM KV ÷ pages", "NVMe KV ÷ pages"],
                [[format_size(parse_size(r["page"])), r["block"], r["blocks"], r["dram"], r["nvme"]] for r in rows])
    write_json(args.json, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
