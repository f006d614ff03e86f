"""kvstore as SGLang's hierarchical-cache (HiCache) storage tier: a `HiCacheStorage` backend that
SGLang's storage backend factory loads by module path and class name.

    python -m sglang.launch_server ... --enable-hierarchical-cache \
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        '{"backend_name": "kvstore", "module_path": "kvstore.connector.sglang",
          "class_name": "KVStoreHiCache", "directory_url": "http://127.0.0.1:8700", "interface_v1": 1}'

A block is one SGLang page: its K and V for every layer, in the host pool's order (`page_first`:
[K,V][token][layer][head][dim]; `layer_first` and `page_first_direct`: [K,V][layer][token][head][dim]).
The namespace records that order, SGLang's key scheme and the tensor-parallel shard, so engines of
another kind or layout never read these blocks. SGLang's page keys (hex digests of the token
chain) are the block hashes; a page's parent is the key before it.

With `interface_v1`, pages move straight between SGLang's host pool and the DRAM arena of a
worker on this host (one copy, hashed as it is copied); otherwise (another host, the older
interface) through the client's registered staging buffer and then the same-host copy or NIXL.
Keys are asked in one lookup per batch. Every failure is a miss: a
dead directory or worker makes `batch_exists` 0, a get None or False, a set False, never an
exception into SGLang. `interface_v1` (zero-copy in SGLang's terms: the backend reads and writes
the host pool itself) and the older tensor interface are both served.
"""

from __future__ import annotations

import ctypes
import logging
import re
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.connector.client import KVStoreClient
from kvstore.connector.layer_copies import HostMemory, copy_pages
from kvstore.connector.layout import TORCH_DTYPES
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace

log = logging.getLogger(__name__)
LAYOUTS = {"page_first": "kv_token_layer_head_dim", "layer_first": "kv_layer_token_head_dim",
           "page_first_direct": "kv_layer_token_head_dim"}
HASH_SCHEME = "sglang-page-keys-v1"  # SGLang's own chained page hashes; the store cannot compute them
BATCH_PAGES = 128  # SGLang's storage batches are at most this many pages
_HEX = re.compile(r"[0-9a-f]{2,128}")


def block_hash(key: str) -> bytes:
    """SGLang's page key as a block hash: its digest as is, any other key hashed."""
    return bytes.fromhex(key) if _HEX.fullmatch(key) and len(key) % 2 == 0 else xxhash.xxh3_128_digest(key.encode())


class KVStoreHiCache(HiCacheStorage):
    """extra_config: directory_url (required; several comma-separated), token (else $KVSTORE_TOKEN),
    tenant (the engine token's), timeout_s, same_host ("auto" | "off")."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        if not extra.get("directory_url"):
            raise KVStoreError("invalid", 'the kvstore HiCache backend needs extra_config.directory_url, e.g. '
                               '{"directory_url": "http://127.0.0.1:8700"}')
        self.config, self.extra = storage_config, extra
        self.client: KVStoreClient | None = None
        self.namespace: Namespace | None = None
        self.memory = HostMemory()  # the host pool, for copies straight into and out of it
        self.pages = {"direct": 0, "staged": 0}  # pages moved by each path (saves and loads)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """The host pool fixes what a page is: the namespace, and the client that moves pages."""
        super().register_mem_pool_host(mem_pool_host)
        pool, config = mem_pool_host, self.config
        mha = all(hasattr(pool, a) for a in ("layout", "layer_num", "head_num", "head_dim", "page_size", "dtype"))
        if not mha or pool.layout not in LAYOUTS or getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise KVStoreError("invalid", f"the kvstore HiCache backend stores MHA host pools of layout "
                               f"{sorted(LAYOUTS)} with equal K and V widths, not "
                               f"{getattr(pool, 'layout', None)!r} ({type(pool).__name__})")
        self.namespace = Namespace(
            model_id=config.model_name or "sglang", num_layers=pool.layer_num, num_kv_heads=pool.head_num,
            head_dim=pool.head_dim, dtype={v: k for k, v in TORCH_DTYPES.items()}[pool.dtype], block_tokens=pool.page_size,
            layout=LAYOUTS[pool.layout], tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank,
            pp_size=config.pp_size, tenant=str(self.extra.get("tenant", "")), hash_scheme=HASH_SCHEME)
        self.client = KVStoreClient(self.extra["directory_url"], self.namespace,
                                    staging_bytes=BATCH_PAGES * self.namespace.block_nbytes,
                                    token=self.extra.get("token"), timeout_s=float(self.extra.get("timeout_s", 30)),
                                    same_host=self.extra.get("same_host"))
        buffer = getattr(pool, "kv_buffer", None)
        if isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu":
            self.memory.add(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    # ---- existence ----------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys the store holds: one lookup for the batch."""
        if not keys or self.client is None:
            return 0
        try:
            return self.client.directory.lookup(self.client.namespace_id,
                                                [block_hash(k).hex() for k in keys]).num_hit_blocks
        except KVStoreError as exc:
            log.warning("kvstore lookup failed (%s): a miss", exc)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- pages in the host pool (interface_v1) ------------------------------------------

    def _addrs(self, host_indices: torch.Tensor, n: int) -> list[list[tuple[int, int]]]:
        """Per page, the (address, bytes) pieces of the host pool holding its block, in the stored
        order (K pieces, then V)."""
        pool = self.mem_pool_host
        ptrs, sizes = pool.get_page_buffer_meta(host_indices[:n * pool.page_size])
        per_page = len(ptrs) // n
        pages = []
        for i in range(n):
            pieces = list(zip(ptrs[i * per_page:(i + 1) * per_page], sizes[i * per_page:(i + 1) * per_page]))
            pages.append(pieces[0::2] + pieces[1::2])
        return pages

    def _pieces(self, host_indices: torch.Tensor, n: int) -> list[list[np.ndarray]]:
        """`_addrs` as arrays over the host pool's memory (for the staged path's copies)."""
        return [[np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr)) for addr, size in page]
                for page in self._addrs(host_indices, n)]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self.client is None or not keys:
            return [False] * len(keys)
        direct = self._save_direct(keys, host_indices, extra_info)
        if direct is not None:
            self.pages["direct"] += sum(direct)
            return direct
        blocks = self._staged(len(keys))
        for block, pieces in zip(blocks, self._pieces(host_indices, len(keys))):
            np.concatenate(pieces, out=block)
        return self._save(keys, blocks, extra_info)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self.client is None or not keys:
            return [False] * len(keys)
        direct = self._load_direct(keys, host_indices)
        if direct is not None:
            self.pages["direct"] += sum(direct)
            return direct
        blocks = self._staged(len(keys))
        n = self._load(keys, blocks)
        for block, pieces in zip(blocks[:n], self._pieces(host_indices, n) if n else []):
            at = 0
            for piece in pieces:
                piece[:] = block[at:at + piece.size]
                at += piece.size
        return [i < n for i in range(len(keys))]

    # ---- straight between the host pool and a same-host worker's arena ---------------------

    def _arenas(self, locations: list[specs.ReplicaLocation]) -> list | None:
        """The mapped arena of each location, or None unless every one is mapped (then the
        staged path moves the pages, NIXL included)."""
        arenas = [self.client.copier.arenas.view(location) for location in locations]
        return arenas if all(a is not None for a in arenas) else None

    def _copy(self, op: str, addrs: list[tuple[int, int]], location: specs.ReplicaLocation, arena) -> str | None:
        """One page's pieces (addr, bytes), in the stored order, copied with its runs in the arena;
        the xxh3 of the bytes as they now are at the destination, None if a piece fell outside."""
        hasher, at = xxhash.xxh3_64(), 0
        for addr, size in addrs:
            if copy_pages(op, [(addr, location.runs, hasher)], at, at + size, self.memory, arena).state != "done":
                return None
            at += size
        return hasher.hexdigest()

    def _save_direct(self, keys: list[str], host_indices: torch.Tensor, extra_info) -> list[bool] | None:
        """Pages written into the arena of a worker on this host straight from the host pool (one
        copy), hashed as they are copied; None when some page is placed elsewhere (nothing kept)."""
        hashes = [block_hash(k).hex() for k in keys]
        parent = _parent(extra_info)
        parents = [parent.hex() if parent else None] + hashes[:-1]
        try:
            prepared = self.client.directory.prepare_store(specs.PrepareStore(
                namespace_id=self.client.namespace_id, writer=self.client.agent.name, hosts=self.client.hosts,
                blocks=[specs.BlockToStore(hash=h, parent=p, nbytes=self.namespace.block_nbytes)
                        for h, p in zip(hashes, parents)]))
            admitted = [(i, d) for i, d in enumerate(prepared.blocks) if d.status == "admitted"]
            arenas = self._arenas([d.location for _, d in admitted])
            addrs = self._addrs(host_indices, len(keys)) if arenas is not None else []
            sums = [self._copy("WRITE", addrs[i], d.location, arena) for (i, d), arena in
                    zip(admitted, arenas)] if arenas is not None else [None] * len(admitted)
            if prepared.token is not None:
                self.client.directory.complete_store(specs.CompleteStore(token=prepared.token, blocks=[
                    specs.BlockWritten(hash=d.hash, ok=s is not None, checksum=s) for (_, d), s in zip(admitted, sums)]))
        except KVStoreError as exc:
            log.warning("kvstore save failed (%s): pages not stored", exc)
            return [False] * len(keys)
        if arenas is None:
            return None  # rolled back: the staged path saves them
        stored = {i for (i, _), s in zip(admitted, sums) if s is not None} | \
            {i for i, d in enumerate(prepared.blocks) if d.status == "exists"}
        held = next((i for i in range(len(keys)) if i not in stored), len(keys))
        return [i < held for i in range(len(keys))]

    def _load_direct(self, keys: list[str], host_indices: torch.Tensor) -> list[bool] | None:
        """The leading pages found, read from a same-host worker's arena straight into the host
        pool and checked against their checksums; None when some page is elsewhere."""
        try:
            prepared = self.client.directory.prepare_load(specs.PrepareLoad(
                namespace_id=self.client.namespace_id, hashes=[block_hash(k).hex() for k in keys],
                reader=self.client.agent.name))
            arenas = self._arenas([hit.location for hit in prepared.blocks])
            verified, reports = 0, []
            if arenas is not None and prepared.blocks:
                addrs = self._addrs(host_indices, len(prepared.blocks))
                for i, (hit, arena) in enumerate(zip(prepared.blocks, arenas)):
                    good = self._copy("READ", addrs[i], hit.location, arena) == hit.checksum
                    if not good:
                        reports.append(specs.BlockRead(hash=hit.hash, ok=False))
                    verified += good and verified == i
            if prepared.token is not None:
                self.client.directory.complete_load(specs.CompleteLoad(token=prepared.token, blocks=reports))
        except KVStoreError as exc:
            log.warning("kvstore load failed (%s): a miss", exc)
            return [False] * len(keys)
        if arenas is None:
            return None
        return [i < verified for i in range(len(keys))]

    # ---- pages as tensors (the older interface) -----------------------------------------

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if self.client is None or not keys:
            return False
        blocks = self._staged(len(keys))
        for block, value in zip(blocks, values):
            block[:] = _bytes_of(value)
        return all(self._save(keys, blocks, None))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """Into `target_locations` (flat page tensors) when given, else new tensors; None past the
        leading pages found."""
        if self.client is None or not keys:
            return [None] * len(keys)
        blocks = self._staged(len(keys))
        n = self._load(keys, blocks)
        dtype = getattr(self.mem_pool_host, "dtype", torch.uint8)
        out = []
        for i, key in enumerate(keys):
            if i >= n:
                out.append(None)
                continue
            target = target_locations[i] if target_locations is not None else \
                torch.empty(self.namespace.block_nbytes // dtype.itemsize, dtype=dtype)
            _bytes_of(target)[:] = blocks[i]
            out.append(target)
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # ---- the store ----------------------------------------------------------------------

    def _staged(self, n: int) -> list[np.ndarray]:
        if n > self.client.slots:
            raise KVStoreError("invalid", f"at most {self.client.slots} pages per call (SGLang batches {BATCH_PAGES})")
        size = self.namespace.block_nbytes
        return [self.client.staging.view(i * size, size) for i in range(n)]

    def _save(self, keys: list[str], blocks: list[np.ndarray], extra_info) -> list[bool]:
        try:
            held = self.client.save_blocks([block_hash(k) for k in keys], blocks, parent=_parent(extra_info))
        except KVStoreError as exc:
            log.warning("kvstore save failed (%s): pages not stored", exc)
            held = 0
        self.pages["staged"] += held
        return [i < held for i in range(len(keys))]

    def _load(self, keys: list[str], blocks: list[np.ndarray]) -> int:
        try:
            n = self.client.load_blocks([block_hash(k) for k in keys], blocks)
        except KVStoreError as exc:
            log.warning("kvstore load failed (%s): a miss", exc)
            return 0
        self.pages["staged"] += n
        return n

    def clear(self) -> None:
        """Nothing: the store's blocks are shared with other engines and evicted by its policies."""

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def _parent(extra_info: HiCacheStorageExtraInfo | None) -> bytes | None:
    """The stored block before a batch: the last of SGLang's prefix keys, if it sent them."""
    prefix = (extra_info.prefix_keys if extra_info is not None else None) or []
    return block_hash(prefix[-1]) if prefix else None


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes (no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise KVStoreError("invalid", "HiCache pages must be contiguous host tensors")
    return flat.view(torch.uint8).numpy()
