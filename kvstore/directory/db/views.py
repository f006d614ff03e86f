"""What the lookup index hands out: the topology's views, a replica, an entry, a lookup's hit.

The index (`index.py`) keeps its blocks' entries and replicas as plain tuples with these fields, not
as these classes: the garbage collector stops tracking a plain tuple of plain values, never an
instance of a tuple subclass, and a full collection walks every tracked one (171 ms at 307,200
blocks, measured). An `Entry`, `ReplicaView` or `Hit` is built when a block leaves the index; the
topology's few views are kept as they are.
"""

from __future__ import annotations

from typing import NamedTuple

from kvstore.core import specs


class TierView(NamedTuple):
    id: int
    worker_id: int
    kind: str
    page_bytes: int
    base_addr: int
    capacity_bytes: int | None = None
    device: int = 0  # an HBM tier's CUDA device


class WorkerView(NamedTuple):
    id: int
    name: str
    agent_name: str
    epoch: int
    state: str
    control_url: str = ""
    backends: tuple[str, ...] = ()


class ReplicaView(NamedTuple):
    """A replica as a lookup hands it out. The index keeps one as (id, tier id, epoch, first, count,
    ...): its pages in the same tuple, 64 bytes less a block than a tuple of pages beside it."""
    id: int
    tier_id: int
    epoch: int
    pages: tuple  # (first, count, first, count, ...): flat, a tuple less per block

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self.pages[::2], self.pages[1::2]))

    @classmethod
    def of(cls, replica: tuple) -> ReplicaView:
        return cls(replica[0], replica[1], replica[2], replica[3:])


class Entry(NamedTuple):
    block_id: int
    namespace_id: str
    hash: str
    nbytes: int
    checksum: str
    replicas: tuple  # ReplicaViews, best tier first
    home: tuple  # of replicas[0] (see Index._home)


class Hit(NamedTuple):
    """One leading block of a lookup and the replica a reader gets."""
    hash: str
    block_id: int
    nbytes: int
    checksum: str
    replica_id: int
    entry: tuple  # the block's entry as the index keeps it (an Entry's fields)
    replica: tuple  # the replica read, as kept (a ReplicaView's fields)
    tier: TierView
    worker: WorkerView

    def runs(self) -> list[tuple[int, int]]:  # of the replica read
        return ReplicaView.of(self.replica).runs()


def location(worker: WorkerView, tier, pages, nbytes: int) -> dict:
    """Where a replica of `nbytes` in `pages` (page runs) of `tier` is, for a connector (a ReplicaLocation's
    fields): absolute (address, length) runs in the worker's memory, or offsets in one object. An HBM
    tier's CUDA device is said when it is not 0 (an engine reads the runs there, over NIXL)."""
    runs = [(0, nbytes)] if tier.kind == "s3" else specs.page_spans(tier.base_addr, tier.page_bytes, pages, nbytes)
    body = {"worker": worker.name, "epoch": worker.epoch, "agent_name": worker.agent_name, "tier": tier.kind,
            "runs": runs}
    if tier.device:
        body["device"] = tier.device
    return body
