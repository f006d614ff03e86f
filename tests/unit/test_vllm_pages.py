"""vLLM's page layouts as the connector sees them: which ones it can store (a page must be one run
of bytes), the pages it accepts for each, and the checksums of pages taken in memory order."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvstore.connector.page_checksums import block_checksums
from kvstore.connector.vllm.checks import checked_pages, page_layout
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import VLLM_LAYOUTS

HND, NHD = VLLM_LAYOUTS
BLOCKS, HEADS, TOKENS, WIDTH = 4, 2, 3, 8


def caches(layout: str) -> dict[str, torch.Tensor]:
    """Two layers of vLLM's logical [blocks, heads, tokens, K|V] views over one allocation."""
    if layout == NHD:
        backing = torch.arange(2 * BLOCKS * TOKENS * HEADS * WIDTH, dtype=torch.float32).view(
            2, BLOCKS, TOKENS, HEADS, WIDTH).transpose(2, 3)
    else:
        backing = torch.arange(2 * BLOCKS * HEADS * TOKENS * WIDTH, dtype=torch.float32).view(
            2, BLOCKS, HEADS, TOKENS, WIDTH)
    return {"l0": backing[0], "l1": backing[1]}


@pytest.mark.parametrize("name, expected", [("LBHNC", HND), ("BLHNC", HND), (None, HND),
                                            ("LBNHC", NHD), ("BLNHC", NHD)])
def test_vllm_layouts_whose_pages_are_one_run_map_to_a_store_layout(name, expected):
    assert page_layout(name) == expected


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_layouts_that_split_a_page_are_refused_at_start_up(name):
    with pytest.raises(KVStoreError, match="splits a block's page"):
        page_layout(name)


@pytest.mark.parametrize("given, said", [(HND, HND), (NHD, NHD), (HND, NHD), (NHD, HND)])
def test_pages_are_accepted_only_in_the_byte_order_the_namespace_says(given, said):
    kv = caches(given)
    if given == said:
        storages = checked_pages(kv, ["l0", "l1"], (HEADS, TOKENS, WIDTH), torch.float32, said)
        assert list(storages.values())[0][0] == 2 * BLOCKS * HEADS * TOKENS * WIDTH * 4
    else:
        with pytest.raises(KVStoreError, match=f"in {said} order"):
            checked_pages(kv, ["l0", "l1"], (HEADS, TOKENS, WIDTH), torch.float32, said)


def test_the_checksum_of_an_nhd_page_is_of_its_bytes_as_they_lie_in_memory():
    kv = caches(NHD)
    stored = [b"".join(kv[name][b].transpose(0, 1).contiguous().numpy().tobytes() for name in ("l0", "l1"))
              for b in (1, 3)]  # tokens outermost: the order of the allocation
    assert block_checksums(kv, ["l0", "l1"], [1, 3]) == [xxhash.xxh3_64_hexdigest(s) for s in stored]
    logical = b"".join(kv[name][1].contiguous().numpy().tobytes() for name in ("l0", "l1"))
    assert xxhash.xxh3_64_hexdigest(logical) != block_checksums(kv, ["l0", "l1"], [1])[0]
