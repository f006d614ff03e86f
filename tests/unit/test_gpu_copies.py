"""The GPU same-host copy's plan and its gather/scatter, run here on CPU tensors (the same index
arithmetic and the same torch calls a CUDA host runs on the GPU; tests/integration/test_hbm.py runs
them there): every layer's page of every block lands where the NIXL descriptors would put it."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.connector.gpu_copies import MIN_ROW_BYTES, move_rows, plan_rows, _storage_bytes
from kvstore.connector.layer_copies import pieces

LAYERS, BLOCKS, PAGE = 3, 8, 512  # a page: [4, 64] bf16
BASE = 1 << 20  # the arena's address in the worker


def stored_runs() -> list[list[tuple[int, int]]]:
    """Where each block of LAYERS pages lives in the arena: out of order, block 5 in two runs."""
    block = LAYERS * PAGE
    slots = [6, 0, 3, 7, 1, None, 2, 4]
    runs = [[(BASE + s * block, block)] if s is not None else [] for s in slots]
    runs[5] = [(BASE + 8 * block, 768), (BASE + 10 * block, block - 768)]  # split inside layer 1's page
    return runs


def move(op: str, pages: torch.Tensor, arena: np.ndarray, block_ids: list[int], runs) -> None:
    here, there = _storage_bytes(pages[0]), torch.from_numpy(arena)
    for layer in range(LAYERS):
        cache = pages[layer]
        step = cache.stride(0) * cache.element_size()
        rows = [(cache.data_ptr() + b * step, r) for b, r in zip(block_ids, runs)]
        here_at, there_at, n = pieces(rows, layer * PAGE, (layer + 1) * PAGE)
        planned = plan_rows(here_at - here.data_ptr(), there_at - BASE, n, here.numel(), there.numel())
        assert planned is not None
        row, here_idx, there_idx = planned
        assert row == (PAGE if layer == 0 else 256)  # block 5's second run starts within layer 1's page
        move_rows(op, here, there, row, torch.from_numpy(here_idx), torch.from_numpy(there_idx))


def test_a_save_scatters_each_layers_pages_into_the_blocks_runs_and_a_load_gathers_them_back():
    pages = torch.randn((LAYERS, 2 * BLOCKS, 4, 64)).to(torch.bfloat16)
    arena = np.zeros(12 * LAYERS * PAGE, dtype=np.uint8)
    runs = stored_runs()
    move("WRITE", pages, arena, list(range(BLOCKS)), runs)
    for b, block_runs in enumerate(runs):  # the block in the arena: its pages of every layer, in layer order
        stored = np.concatenate([arena[a - BASE:a - BASE + n] for a, n in block_runs])
        expected = np.concatenate([pages[layer, b].view(torch.uint8).reshape(-1).numpy() for layer in range(LAYERS)])
        assert np.array_equal(stored, expected), b
    move("READ", pages, arena, list(range(BLOCKS, 2 * BLOCKS)), runs)
    assert torch.equal(pages[:, BLOCKS:].view(torch.int16), pages[:, :BLOCKS].view(torch.int16))


def test_pieces_outside_either_side_or_cut_too_fine_are_left_to_nixl():
    n = np.array([PAGE, PAGE])
    assert plan_rows(np.array([0, PAGE]), np.array([0, 4 * PAGE]), n, 2 * PAGE, 8 * PAGE)[0] == PAGE
    assert plan_rows(np.array([0, PAGE]), np.array([0, 8 * PAGE]), n, 2 * PAGE, 8 * PAGE) is None  # past the arena
    assert plan_rows(np.array([-PAGE, 0]), np.array([0, PAGE]), n, 2 * PAGE, 8 * PAGE) is None  # before the pages
    fine = MIN_ROW_BYTES // 2
    assert plan_rows(np.array([0, PAGE]), np.array([fine, 4 * PAGE]), n, 2 * PAGE, 8 * PAGE) is None
    assert plan_rows(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), PAGE, PAGE) is None


def test_rows_move_in_chunks_that_bound_the_temporary(monkeypatch):
    """A layer's rows are gathered CHUNK_BYTES at a time (the temporary on the GPU stays small)."""
    monkeypatch.setattr("kvstore.connector.gpu_copies.CHUNK_BYTES", 3 * PAGE)  # 8 rows: chunks of 3, 3, 2
    test_a_save_scatters_each_layers_pages_into_the_blocks_runs_and_a_load_gathers_them_back()
