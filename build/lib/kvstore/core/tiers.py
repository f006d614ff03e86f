"""The tier vocabulary, defined once.

A worker has up to four tiers, fastest first. Memory tiers are volatile (a
worker's new epoch starts them empty), engines read and write them one-sidedly
over UCX, and new blocks are placed there. Durable tiers survive a worker
restart and are reached by the worker's own moves.
"""

from __future__ import annotations

ORDER = ("hbm", "dram", "nvme", "s3")
MEMORY = ("hbm", "dram")
ENGINE_READABLE = MEMORY  # what a connector reads and writes itself, over UCX
DURABLE = ("nvme", "s3")
PREFERENCE = {kind: rank for rank, kind in enumerate(ORDER)}  # lower is better: the replica a reader gets


def below(kinds: set[str] | dict, kind: str, gds: bool = False) -> str | None:
    """The next tier down among `kinds` (what one worker has), or None at the bottom. With GDS,
    HBM goes straight to NVMe (GPU to disk without a bounce through host memory)."""
    if kind == "hbm" and gds and "nvme" in kinds:
        return "nvme"
    return next((k for k in ORDER[ORDER.index(kind) + 1:] if k in kinds), None)
