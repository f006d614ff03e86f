"""Executes the directory's moves between this worker's tiers with NIXL.

    mover.move(MoveRequest) -> MoveResult     # one item at a time; failures are values

DRAM -> NVMe: the DRAM bytes must still hash to the block's checksum, then a
POSIX WRITE puts them in the slab pages and the manifest records them.
NVMe -> DRAM (promotion): a POSIX READ, then the DRAM copy must hash to the
checksum; a mismatch fails the item, so corrupt bytes never become a replica.
"""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from kvstore.core import specs
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent
from kvstore.worker.nvme import NvmeTier

log = logging.getLogger(__name__)


class Mover:
    def __init__(self, agent: Agent, arena: HostBuffer, page_bytes: int, nvme: NvmeTier | None) -> None:
        self.agent = agent
        self.arena = arena
        self.page_bytes = page_bytes
        self.nvme = nvme

    def move(self, req: specs.MoveRequest) -> specs.MoveResult:
        ok, errors = [], []
        for item in req.items:
            error = self._move_one(item)
            ok.append(error is None)
            errors.append(error)
            if error:
                log.warning("move of block %s %s->%s failed: %s", item.hash, item.src_kind, item.dst_kind, error)
        return specs.MoveResult(ok=ok, errors=errors)

    def _move_one(self, item: specs.MoveItem) -> str | None:
        route = (item.src_kind, item.dst_kind)
        if self.nvme is None or route not in (("dram", "nvme"), ("nvme", "dram")):
            return f"this worker cannot move {item.src_kind} -> {item.dst_kind}"
        if route == ("dram", "nvme"):
            if self.dram_checksum(item.src_runs, item.nbytes) != item.checksum:
                return "checksum mismatch in DRAM before demotion"
            error = self._transfer("WRITE", item.src_runs, item.dst_runs, item.nbytes)
            if error is None:
                self.nvme.record(item)
            return error
        error = self._transfer("READ", item.dst_runs, item.src_runs, item.nbytes)
        if error is None and self.dram_checksum(item.dst_runs, item.nbytes) != item.checksum:
            return "checksum mismatch after reading from NVMe"
        return error

    def _transfer(self, op: str, dram_runs, nvme_runs, nbytes: int) -> str | None:
        local, remote = _paired(self.dram_rows(dram_runs, nbytes), self.nvme.rows(nvme_runs, nbytes))
        transfer = self.agent.submit(op, local, remote, self.agent.name, "DRAM", "FILE")
        return None if transfer.wait(120) == "done" else transfer.error

    def dram_rows(self, runs: list[specs.PageRun], nbytes: int) -> np.ndarray:
        rows, left = [], nbytes
        for run in runs:
            length = min(run.count * self.page_bytes, left)
            rows.append((self.arena.addr + run.first * self.page_bytes, length))
            left -= length
        assert left == 0, "pages do not cover the block"
        return np.array(rows, dtype=np.uint64)

    def dram_checksum(self, runs: list[specs.PageRun], nbytes: int) -> str:
        hasher = xxhash.xxh3_64()
        for addr, length in self.dram_rows(runs, nbytes):
            hasher.update(self.arena.view(int(addr) - self.arena.addr, int(length)))
        return hasher.hexdigest()


def _paired(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split two descriptor lists of equal total length at the union of their boundaries,
    so descriptor i of one has the length of descriptor i of the other."""
    out_l, out_r = [], []
    i = j = 0
    l_off = r_off = 0
    while i < len(local) and j < len(remote):
        length = min(int(local[i][1]) - l_off, int(remote[j][1]) - r_off)
        out_l.append((int(local[i][0]) + l_off, length) + tuple(int(x) for x in local[i][2:]))
        out_r.append((int(remote[j][0]) + r_off, length) + tuple(int(x) for x in remote[j][2:]))
        l_off += length
        r_off += length
        if l_off == int(local[i][1]):
            i, l_off = i + 1, 0
        if r_off == int(remote[j][1]):
            j, r_off = j + 1, 0
    assert i == len(local) and j == len(remote), "descriptor lists differ in total length"
    return np.array(out_l, dtype=np.uint64), np.array(out_r, dtype=np.uint64)
