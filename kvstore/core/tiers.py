"""The tier vocabulary, defined once.

A worker has up to four tiers, fastest first. Memory tiers are volatile (a
worker's new epoch starts them empty), engines read and write them one-sidedly
over UCX, and new blocks are placed there. Durable tiers survive a worker
restart and are reached by the worker's own moves.
"""

from __future__ import annotations

from itertools import groupby

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


def tier_runs(keys, kind_of=lambda key: key) -> list[tuple[str, int]]:
    """[(tier kind, blocks), ...] for consecutive blocks of the same kind. `keys` (one per block) are
    grouped in C; `kind_of` names a key's tier kind once per group."""
    runs: list[tuple[str, int]] = []
    for key, group in groupby(keys):
        kind, n = kind_of(key), len(list(group))
        if runs and runs[-1][0] == kind:  # two tiers of one kind (on two workers) side by side
            n += runs.pop()[1]
        runs.append((kind, n))
    return runs
