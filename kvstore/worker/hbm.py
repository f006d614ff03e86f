"""The HBM tier: one CUDA buffer allocated and registered (VRAM) once, split into pages.

    arena = HbmArena(nbytes, device)   # refuses, with one line, a host without CUDA
    arena.register(agent)              # VRAM registration with the agent's backends (UCX, GDS)
    arena.rows(runs, nbytes)           # (device address, len, device) rows of a block's pages
    arena.checksum(runs, nbytes)       # xxh3_64 of the bytes, copied to the host to hash
    arena.gds_probe(agent, file_row)   # whether GDS reads the NVMe tier's files into it (at start-up)

GPU path: written to the same interfaces as the DRAM arena, exercised by the tests marked `gpu`
(skipped without CUDA).
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.pages import PageAllocator


class HbmArena:
    def __init__(self, nbytes: int, page_bytes: int, device: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise KVStoreError("unavailable", "an HBM tier needs a CUDA GPU and this host has none; "
                               "start without --hbm-bytes", hbm_bytes=nbytes)
        num_pages = nbytes // page_bytes
        if num_pages < 1:
            raise KVStoreError("invalid", "the HBM tier must hold at least one page", hbm_bytes=nbytes)
        self.device = device
        self.page_bytes = page_bytes
        self.tensor = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.addr = self.tensor.data_ptr()
        self.nbytes = self.tensor.numel()
        self.allocator = PageAllocator(num_pages, page_bytes)

    def register(self, agent) -> None:
        agent.register_vram(self.addr, self.nbytes, self.device)

    def gds_probe(self, agent, file_row: tuple[int, int, int]) -> str:
        """Whether GDS moves bytes between this arena and the NVMe tier's files ("done", "failed", or
        "pending" after 10 s): one page read from a file into the first page (free at start-up).
        cuFile refuses files on a filesystem it cannot reach (NIXL then has no backend for the
        request), and fails reads it cannot do."""
        local = self.rows([specs.PageRun(first=0, count=1)], file_row[1])
        remote = np.array([file_row], dtype=np.uint64)
        return agent.submit("READ", local, remote, agent.name, "VRAM", "FILE").wait(10.0)

    def rows(self, runs: list[specs.PageRun], nbytes: int) -> np.ndarray:
        spans = specs.page_spans(self.addr, self.page_bytes, runs, nbytes)
        return np.array([(addr, length, self.device) for addr, length in spans], dtype=np.uint64)

    def checksum(self, runs: list[specs.PageRun], nbytes: int) -> str:
        hasher = xxhash.xxh3_64()
        for addr, length, _ in self.rows(runs, nbytes):
            start = int(addr) - self.addr
            hasher.update(self.tensor[start : start + int(length)].cpu().numpy())
        return hasher.hexdigest()
