"""kvstore as SGLang's HiCache storage tier, against SGLang's own interface and factory and a real
stack (directory and worker processes): every abstract method implemented, pages round-trip
byte-exact through both of SGLang's interfaces and every supported layout, batch existence is a
prefix count, a dead worker or directory is a miss and never an exception, and engines of
another kind or layout never share blocks."""

from __future__ import annotations

import hashlib

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.connector.sglang import KVStoreHiCache
from kvstore.core.keys import Namespace
from tests_sglang.conftest import HostPool

LAYOUTS = ["page_first", "layer_first", "page_first_direct"]


def config(url: str, tp_rank: int = 0, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny/contract",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.connector.sglang",
                      "class_name": "KVStoreHiCache", "directory_url": url, "interface_v1": 1, **extra})


def keys(n: int, seed: str = "a") -> list[str]:
    """SGLang's page keys: a sha256 chain over the pages' tokens."""
    out, prior = [], seed
    for i in range(n):
        prior = hashlib.sha256(f"{prior}/{i}".encode()).hexdigest()
        out.append(prior)
    return out


def backend(url: str, pool: HostPool, **kw) -> KVStoreHiCache:
    made = StorageBackendFactory.create_backend("dynamic", config(url, **kw), pool)
    made.register_mem_pool_host(pool)  # as SGLang's cache controller does right after
    return made


def test_every_abstract_method_is_implemented_and_sglangs_factory_loads_it(stack):
    assert not (HiCacheStorage.__abstractmethods__ - {m for m in HiCacheStorage.__abstractmethods__
                                                      if getattr(KVStoreHiCache, m) is not getattr(HiCacheStorage, m)})
    made = backend(stack.url, HostPool("page_first"))
    assert isinstance(made, KVStoreHiCache) and isinstance(made, HiCacheStorage)
    for method in ("batch_get_v1", "batch_set_v1", "batch_exists", "get", "set", "batch_get", "batch_set", "exists"):
        assert getattr(KVStoreHiCache, method) is not getattr(HiCacheStorage, method), method
    made.close()
    other = HostPool("page_first")
    other.layout = "page_head"  # a layout whose pages the backend does not store
    with pytest.raises(Exception, match="not 'page_head'"):
        backend(stack.url, other)
    with pytest.raises(Exception, match="directory_url"):
        KVStoreHiCache(HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "m", extra_config={}))


@pytest.mark.parametrize("layout, same_host", [(layout, "auto") for layout in LAYOUTS] + [("page_first", "off")])
def test_pages_round_trip_byte_exact_through_both_interfaces(stack, layout, same_host):
    pool = HostPool(layout)
    pool.fill(seed=1)
    made = backend(stack.url, pool, same_host=same_host)
    first = keys(5, "v1")
    assert made.batch_set_v1(first, pool.indices(0, 5)) == [True] * 5
    before = [pool.page(i) for i in range(5)]
    assert made.batch_get_v1(first, pool.indices(8, 5)) == [True] * 5  # into other pages
    assert all(torch.equal(pool.page(8 + i).view(torch.int16), before[i].view(torch.int16)) for i in range(5))
    # interface_v1 on the worker's host: straight between the host pool and the arena; else staged
    assert made.pages == ({"direct": 10, "staged": 0} if same_host == "auto" else {"direct": 0, "staged": 10})
    # the older interface: flat page tensors (SGLang copies them in and out of the pool itself)
    second = keys(3, "tensors")
    pages = [pool.get_data_page(i * pool.page_size) for i in range(3)]
    assert made.batch_set(second, pages) is True
    got = made.batch_get(second, [pool.get_dummy_flat_data_page() for _ in second])
    assert all(torch.equal(g.view(torch.int16), p.view(torch.int16)) for g, p in zip(got, pages))
    assert made.get(second[0], pool.get_dummy_flat_data_page()) is not None and made.exists(second[2])
    assert made.batch_get(keys(2, "never"), [pool.get_dummy_flat_data_page()] * 2) == [None, None]
    made.close()


def test_layouts_that_store_the_same_order_share_pages_and_the_others_do_not(stack):
    layer_first, direct, page_first = HostPool("layer_first"), HostPool("page_first_direct"), HostPool("page_first")
    layer_first.fill(seed=2)
    a, b, c = (backend(stack.url, p) for p in (layer_first, direct, page_first))
    chain = keys(4, "shared")
    assert a.batch_set_v1(chain, layer_first.indices(0, 4)) == [True] * 4
    assert b.batch_exists(chain) == 4 and c.batch_exists(chain) == 0  # page_first stores another order
    assert b.batch_get_v1(chain, direct.indices(2, 4)) == [True] * 4
    assert all(torch.equal(direct.page(2 + i).view(torch.int16), layer_first.page(i).view(torch.int16))
               for i in range(4))
    assert a.namespace.namespace_id == b.namespace.namespace_id != c.namespace.namespace_id
    for made in (a, b, c):
        made.close()


def test_batch_existence_is_a_prefix_count_in_one_lookup(stack):
    pool = HostPool("page_first")
    pool.fill(seed=3)
    made = backend(stack.url, pool)
    chain = keys(6, "prefix")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert made.batch_set_v1(chain[:4], pool.indices(0, 4), info) == [True] * 4
    assert made.batch_exists(chain) == 4
    assert made.batch_exists([chain[0], "f" * 64, chain[2]]) == 1  # a gap ends the prefix
    assert made.batch_exists(["0" * 64] + chain) == 0 and made.batch_exists([]) == 0
    calls = []
    lookup = made.client.directory.lookup
    made.client.directory.lookup = lambda *a: calls.append(a) or lookup(*a)
    assert made.batch_exists(chain) == 4 and len(calls) == 1  # the whole batch, one directory call
    made.close()


def test_engines_of_another_kind_or_shard_never_share_blocks(stack):
    pool = HostPool("page_first")
    ranks = [backend(stack.url, pool, tp_rank=r) for r in (0, 1)]
    assert ranks[0].namespace.namespace_id != ranks[1].namespace.namespace_id  # each TP rank its shard
    kvstore_own = Namespace(model_id="tiny/contract", num_layers=pool.layer_num, num_kv_heads=pool.head_num,
                            head_dim=pool.head_dim, dtype="bfloat16", block_tokens=pool.page_size, tp_size=2)
    assert kvstore_own.namespace_id != ranks[0].namespace.namespace_id  # another hash scheme and order
    assert ranks[0].namespace.hash_scheme.startswith("sglang") and ranks[0].namespace.layout == "kv_token_layer_head_dim"
    pool.fill(seed=4)
    chain = keys(2, "rank")
    assert ranks[0].batch_set_v1(chain, pool.indices(0, 2)) == [True, True]
    assert ranks[1].batch_exists(chain) == 0
    for made in ranks:
        made.close()


def test_a_dead_worker_or_directory_is_a_miss_never_an_exception(stack):
    pool = HostPool("page_first")
    pool.fill(seed=5)
    made = backend(stack.url, pool)
    chain = keys(3, "dead")
    assert made.batch_set_v1(chain, pool.indices(0, 3)) == [True] * 3
    stack.stop("worker")  # its DRAM, and every page in it, is gone
    assert made.batch_get_v1(chain, pool.indices(5, 3)) == [False] * 3
    assert made.batch_set_v1(keys(2, "nowhere"), pool.indices(0, 2)) == [False, False]
    stack.stop("directory")
    assert made.batch_exists(chain) == 0 and made.exists(chain[0]) is False
    assert made.batch_get_v1(chain, pool.indices(5, 3)) == [False] * 3
    assert made.batch_set(chain, [pool.get_data_page(0)] * 3) is False
    assert made.batch_get(chain, [pool.get_dummy_flat_data_page()] * 3) == [None] * 3
    made.close()
