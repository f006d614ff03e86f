"""What a saved block costs in SQL alone: the directory's own statements with nothing around them.

The directory's schema (its migrations) in a fresh SQLite database with the directory's settings; then
saves of `--chain` blocks, as the save path's commit writes them (the first free block id, one
multi-row INSERT of the block rows with the ids that follow, the first free replica id and one
multi-row INSERT of the replica rows, COMMIT), straight through `sqlite3`, until `--blocks` are
stored. Each step's thread CPU per block, per stretch of the fill. Beside it, two other schemas for
the same blocks: one row per block with its home replica inline (the replica's tier, epoch, state,
token, pages and bytes as columns of the block row, and an index on (tier, state) as `replicas`
has), and one row per save (the chain's hashes and pages packed in BLOBs).

    .venv/bin/python bench/sql_floor.py --blocks 1000000 --json bench/out/sql_floor.json
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import machine, random_hash  # noqa: E402
from kvstore.directory.db import engine as db  # noqa: E402

PRAGMAS = db.SQLITE_PRAGMAS  # the directory's own
STEPS = ("blocks", "replicas", "commit")


def schema(path: Path) -> sqlite3.Connection:
    url = f"sqlite:///{path}"
    db.upgrade(url)
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in PRAGMAS:
        conn.execute(pragma)
    now = time.time()
    conn.execute("INSERT INTO namespaces (id, spec, created_at, write_through, replicas) VALUES ('ns', '{}', ?, 0, 1)",
                 (now,))
    conn.execute("INSERT INTO workers (id, name, agent_name, agent_metadata, epoch, state, pid, control_url, backends, "
                 "heartbeat_at, registered_at, owner) VALUES (1, 'w', 'a', x'00', 1, 'active', 1, 'http://x', "
                 "'[\"UCX\"]', ?, ?, '')", (now, now))
    conn.execute("INSERT INTO tiers (id, worker_id, kind, capacity_bytes, used_bytes, page_bytes, base_addr, "
                 "high_watermark, low_watermark) VALUES (1, 1, 'dram', ?, 0, 4096, 0, 0.9, 0.8)", (1 << 50,))
    conn.execute("CREATE TABLE inline_blocks (id INTEGER PRIMARY KEY, namespace_id TEXT, hash TEXT, parent TEXT, "
                 "depth INTEGER, nbytes INTEGER, checksum TEXT, created_at REAL, last_access REAL, hit_count INTEGER, "
                 "tier_id INTEGER, epoch INTEGER, state TEXT, token TEXT, pages TEXT, reserved_bytes INTEGER)")
    conn.execute("CREATE INDEX ix_inline_tier_state ON inline_blocks (tier_id, state)")
    conn.execute("CREATE TABLE packed_saves (id INTEGER PRIMARY KEY, namespace_id TEXT, first_hash TEXT, "
                 "hashes BLOB, pages BLOB, checksums BLOB, created_at REAL)")
    conn.execute("CREATE INDEX ix_packed_first ON packed_saves (namespace_id, first_hash)")
    return conn


def block_values(first: int, k: int, hashes: list[str], now: float) -> tuple:
    """Block `k` of a save as its row's values: id, namespace, hash, parent, depth, nbytes, checksum,
    created_at, last_access."""
    return (first + k, "ns", hashes[k], hashes[k - 1] if k else None, k, 65536, f"{k:016x}", now, now)


def pages(chain: int, n: int, k: int) -> str:
    """Block `k`'s page run as a replica row holds it (16 pages of 4 KiB)."""
    return f"[[{16 * (chain * n + k)}, 16]]"


def save_rows(conn: sqlite3.Connection, chain: int, n: int, clock) -> list[float]:
    """One save of `n` blocks as the directory commits it; the CPU of each step."""
    now = time.time()
    hashes = [random_hash(chain, k) for k in range(n)]
    spent = []
    t = clock()
    conn.execute("BEGIN")
    ((first,),) = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM blocks").fetchall()
    values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, 0)"] * n)
    conn.execute("INSERT INTO blocks (id, namespace_id, hash, parent, depth, nbytes, checksum, created_at, "
                 f"last_access, hit_count) VALUES {values}", tuple(
                     x for k in range(n) for x in block_values(first, k, hashes, now)))
    ids = [first + k for k in range(n)]
    spent.append(clock() - t)
    t = clock()
    ((first,),) = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM replicas").fetchall()
    values = ", ".join(["(?, ?, ?, ?, 'ready', ?, ?, ?, ?, ?)"] * n)
    params = tuple(x for k, block_id in enumerate(ids)
                   for x in (first + k, block_id, 1, 1, f"tok{chain}", pages(chain, n, k), 65536, None, now))
    conn.execute("INSERT INTO replicas (id, block_id, tier_id, epoch, state, token, pages, reserved_bytes, expires_at, "
                 f"created_at) VALUES {values}", params)
    spent.append(clock() - t)
    t = clock()
    conn.execute("COMMIT")
    spent.append(clock() - t)
    return spent


def save_inline(conn: sqlite3.Connection, chain: int, n: int, clock) -> float:
    """The same save as `save_rows`, its home replicas inline: one row a block."""
    now = time.time()
    hashes = [random_hash(chain, k) for k in range(n)]
    t = clock()
    conn.execute("BEGIN")
    ((first,),) = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM inline_blocks").fetchall()
    values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, 'ready', ?, ?, ?)"] * n)
    conn.execute("INSERT INTO inline_blocks (id, namespace_id, hash, parent, depth, nbytes, checksum, created_at, "
                 "last_access, hit_count, tier_id, epoch, state, token, pages, reserved_bytes) "
                 f"VALUES {values}", tuple(
                     x for k in range(n)
                     for x in (*block_values(first, k, hashes, now), 1, 1, f"tok{chain}", pages(chain, n, k), 65536)))
    conn.execute("COMMIT")
    return clock() - t


def save_packed(conn: sqlite3.Connection, chain: int, n: int, clock) -> float:
    now = time.time()
    t = clock()
    conn.execute("BEGIN")
    hashes = b"".join(bytes.fromhex(random_hash(chain, k)) for k in range(n))
    pages = b"".join((16 * (chain * n + k)).to_bytes(8, "little") for k in range(n))
    conn.execute("INSERT INTO packed_saves (namespace_id, first_hash, hashes, pages, checksums, created_at) "
                 "VALUES (?, ?, ?, ?, ?, ?)", ("ns", random_hash(chain), hashes, pages, bytes(8 * n), now))
    conn.execute("COMMIT")
    return clock() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--chain", type=int, default=128, help="blocks a save")
    parser.add_argument("--stretches", type=int, default=5, help="report the fill in this many stretches")
    parser.add_argument("--json")
    args = parser.parse_args()
    clock = time.thread_time
    saves = max(1, args.blocks // args.chain)
    per_stretch = max(1, saves // args.stretches)
    stretches = []
    with tempfile.TemporaryDirectory(prefix="kvstore-sql-floor-") as tmp:
        conn = schema(Path(tmp) / "directory.db")
        totals, inline, packed, wall, since = [0.0] * len(STEPS), 0.0, 0.0, time.perf_counter(), 0
        for chain in range(saves):
            for i, s in enumerate(save_rows(conn, chain, args.chain, clock)):
                totals[i] += s
            inline += save_inline(conn, chain, args.chain, clock)
            packed += save_packed(conn, chain, args.chain, clock)
            since += args.chain
            if chain + 1 == saves or ((chain + 1) % per_stretch == 0 and len(stretches) < args.stretches - 1):
                stretches.append({"blocks_stored": (chain + 1) * args.chain,
                                  **{f"{step}_us": 1e6 * s / since for step, s in zip(STEPS, totals)},
                                  "rows_us": 1e6 * sum(totals) / since, "inline_us": 1e6 * inline / since,
                                  "packed_us": 1e6 * packed / since})
                totals, inline, packed, since = [0.0] * len(STEPS), 0.0, 0.0, 0
                print(f"\r{(chain + 1) * args.chain:>10,} blocks", end="", flush=True)
        conn.close()
    print(f"\r{saves * args.chain:,} blocks in saves of {args.chain}, {time.perf_counter() - wall:.0f} s\n")
    header = ["blocks stored", "INSERT blocks", "INSERT replicas", "COMMIT", "rows: total", "replica inline",
              "one row a save"]
    print("  ".join(f"{h:>15}" for h in header) + "   (thread CPU, µs per block)")
    for s in stretches:
        print("  ".join(f"{v:>15}" for v in [f"{s['blocks_stored']:,}", *(f"{s[k]:.2f}" for k in (
            "blocks_us", "replicas_us", "commit_us", "rows_us", "inline_us", "packed_us"))]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"benchmark": "sql_floor", "machine": machine(), "chain": args.chain,
                                               "sqlite": sqlite3.sqlite_version, "stretches": stretches}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
