"""vLLM (>= 0.33) KV connector: vLLM's paged KV cache <-> kvstore, layer by layer.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connector.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"directory_url": "http://127.0.0.1:8700"}}'

Keys are vLLM's own block hashes (`request.block_hashes`, computed by vLLM with its
`prefix_caching_hash_algo` and NONE_HASH), so every engine with the same settings agrees. The
namespace records the hash algorithm, a fingerprint of NONE_HASH, the model, the KV geometry,
the block size and the TP rank; the scheduler sends its id to the workers with each step.

Blocks are stored in vLLM's own page layout, layer-major: block b = the pages kv[l][b] of every
layer l, each [num_kv_heads, block_size, head_size + head_size_v] (`layer_head_token_kvdim`),
so a layer's load or save is one NIXL request with one descriptor per block, straight between
vLLM's paged buffer and the worker, with no staging copy.

Scheduler side: `get_num_new_matched_tokens` (a lookup: full blocks beyond the local hit,
leaving at least one prompt token to compute), `update_state_after_alloc`,
`get_external_cache_hit_sources` (host / disk / external by tier), `build_connector_meta`
(loads, and saves of prompts computed in this step).
Worker side: `register_kv_caches` (the backing buffer, registered once), `start_load_kv` (every
layer's read posted), `wait_for_layer_load` (that layer only), `save_kv_layer` (that layer's
writes posted), `wait_for_save` (saves committed with checksums; loads verified and released;
blocks that failed go to `get_block_ids_with_load_errors`, never reported as loaded).

Loads finish within the step by default; with `"load_async": true` vLLM schedules the request
only once `get_transfer_results` reports its load finished (failed ones also in
`failed_recving`). Saves finish within the step: `request_finished` never delays freeing. Not handled yet: chunked prefill (a prompt computed over several steps is not
saved), hybrid (several KV cache groups) and MLA models, TP > 1 beyond the namespace's rank.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, KVConnectorTransferResults,
                                                                SupportsHMA)

from kvstore.client import DirectoryClient
from kvstore.connector.layerwise import slice_rows
from kvstore.connector.peers import Peers
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace
from kvstore.transfer import Agent

log = logging.getLogger(__name__)
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


@dataclass
class BlockPlan:
    """Blocks of one request to move: store keys (hex) and the vLLM block ids they map to."""
    req_id: str
    hashes: list[str]
    block_ids: list[int]
    load_async: bool = False  # a load vLLM does not wait for in the forward (get_transfer_results)


@dataclass
class _Load:
    plan: BlockPlan
    token: str | None
    hits: list[specs.BlockHit]
    by_layer: dict[str, list] = field(default_factory=dict)  # layer -> one transfer per worker

    def state(self) -> str:
        states = [t.poll() if t is not None else "failed" for ts in self.by_layer.values() for t in ts]
        return "pending" if "pending" in states else "failed" if "failed" in states else "done"


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    namespace_id: str = ""
    loads: list[BlockPlan] = field(default_factory=list)
    saves: list[BlockPlan] = field(default_factory=list)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("directory_url"):
            raise KVStoreError("invalid", "kv_connector_extra_config needs directory_url, e.g. "
                               '{"directory_url": "http://127.0.0.1:8700"}')
        self.block_size = vllm_config.cache_config.block_size
        self.hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self.extra = extra
        self.directory = DirectoryClient(extra["directory_url"], timeout_s=float(extra.get("timeout_s", 30)))
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._namespace_id: str | None = None
        self._matched: dict[str, tuple[Any, int, int]] = {}  # req_id -> (request, first block, hit blocks)
        self._requests: dict[str, Any] = {}  # live requests seen by the scheduler side
        self._sources: dict[str, list[str]] = {}  # req_id -> tier of each matched block
        self._loads: list[BlockPlan] = []
        self.load_async = bool(extra.get("load_async", False))
        self._worker = _WorkerSide(self) if role == KVConnectorRole.WORKER else None
        if role == KVConnectorRole.SCHEDULER and self.hash_algo.startswith("xxhash") \
                and os.environ.get("PYTHONHASHSEED") is None:
            log.warning("prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM seeds its block hashes at "
                        "random, so no other engine will ever hit what this one stores; set PYTHONHASHSEED "
                        "to the same value everywhere, or use sha256", self.hash_algo)

    # ---- keys -------------------------------------------------------------------------

    def namespace(self) -> Namespace:
        from vllm.v1.core import kv_cache_utils

        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if none_hash is None:
            raise KVStoreError("invalid", "vLLM has not initialised NONE_HASH (init_none_hash) yet")
        model = self._vllm_config.model_config.model if self._vllm_config.model_config else self.extra.get("model_id")
        if not model:
            raise KVStoreError("invalid", "no model: set model_config or kv_connector_extra_config.model_id")
        spec = self._spec
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            raise KVStoreError("invalid", "K and V of different head sizes are not supported yet")
        return Namespace(
            model_id=str(model), model_revision=str(self.extra.get("model_revision", "")),
            num_layers=len(self._layer_names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            dtype=DTYPES[spec.dtype], block_tokens=self.block_size, layout="layer_head_token_kvdim",
            tp_rank=int(self.extra.get("tp_rank", 0)), tp_size=self._vllm_config.parallel_config.tensor_parallel_size,
            hash_scheme=f"vllm-{self.hash_algo}-none:{xxhash.xxh64_hexdigest(none_hash)}")

    def _namespace_id_now(self) -> str:
        if self._namespace_id is None:
            self._namespace_id = self.directory.register_namespace(self.namespace())
        return self._namespace_id

    # ---- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` the store holds: whole blocks, and never the whole
        prompt (vLLM must compute at least one token). Side-effect free for the store."""
        self._requests[request.request_id] = request  # its block hashes are needed again when it is saved
        prompt_blocks = (len(request.prompt_token_ids or ()) - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        hashes = [h.hex() for h in request.block_hashes[:prompt_blocks]]
        if len(hashes) <= first:
            return 0, False
        try:
            found = self.directory.lookup(self._namespace_id_now(), hashes)
        except KVStoreError as exc:
            log.warning("lookup for %s failed (%s): computing it", request.request_id, exc)
            return 0, False
        hit = found.num_hit_blocks
        if hit <= first:
            return 0, False
        self._matched[request.request_id] = (request, first, hit)
        self._sources[request.request_id] = [b.location.tier for b in found.blocks[first:hit]]
        return (hit - first) * self.block_size - (num_computed_tokens % self.block_size), self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or matched is None:
            return
        _, first, hit = matched
        block_ids = blocks.get_block_ids()[0]
        hashes = [h.hex() for h in request.block_hashes[first:hit]]
        self._loads.append(BlockPlan(request.request_id, hashes, list(block_ids[first:hit]), self.load_async))

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The matched tokens by the tier that holds them: memory tiers of a storage worker are
        `host`, NVMe is `disk`, S3 is `external_unspecified`; the shortfall of a partial first
        block goes to the first block's tier."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        tiers = self._sources.pop(request.request_id, [])
        if num_external_tokens == 0 or not tiers:
            return {}
        kinds = {"hbm": CacheHitSource.HOST, "dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK,
                 "s3": CacheHitSource.EXTERNAL_UNSPECIFIED}
        counts: dict = {}
        for tier in tiers:
            counts[kinds[tier]] = counts.get(kinds[tier], 0) + self.block_size
        counts[kinds[tiers[0]]] -= len(tiers) * self.block_size - num_external_tokens
        return {source: n for source, n in counts.items() if n > 0}

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(namespace_id=self._namespace_id_now(), loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if new.num_computed_tokens + scheduled < len(prompt):
                continue  # chunked prefill: not saved (see the module docstring)
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            full = len(prompt) // self.block_size
            meta.saves.append(BlockPlan(new.req_id, [h.hex() for h in request.block_hashes[:full]],
                                        list(new.block_ids[0][:full])))
        return meta

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        return False, None  # saves complete within the step: nothing holds the blocks

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    # ---- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        self._worker.finish_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads that ended since the last call; a failed one is in both
        finished_recving and failed_recving, and its blocks in get_block_ids_with_load_errors."""
        finished, failed = self._worker.async_results() if self._worker else (set(), set())
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker else set()

    def shutdown(self) -> None:
        if self._worker:
            self._worker.close()
        self.directory.close()


class _WorkerSide:
    """NIXL between vLLM's paged KV buffer and the workers: one request per (layer, worker)."""

    def __init__(self, connector: KVStoreConnector) -> None:
        self.connector = connector
        self.directory = connector.directory
        self.agent = Agent(f"vllm-kvstore-{uuid.uuid4().hex[:12]}", backends={"UCX": {}})
        self.peers = Peers(self.agent, self.directory)
        self.caches: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._sync: list[_Load] = []  # loads of this forward
        self._async: dict[str, _Load] = {}  # req_id -> a load vLLM polls for between steps
        self._saves: list[tuple[BlockPlan, str | None, list[tuple[int, specs.StoreDecision]]]] = []
        self._save_xfers: list = []
        self._saves_prepared = False

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self.connector._layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise KVStoreError("invalid", f"register_kv_caches lacks layers {missing[:3]}")
        storages = {}
        for name in names:
            t = kv_caches[name]
            if t.dim() != 4 or not t[0].is_contiguous():
                raise KVStoreError("invalid", f"layer {name}: expected [blocks, heads, block_size, head+head_v] "
                                   f"pages, got shape {tuple(t.shape)} strides {t.stride()}")
            ns_heads, ns_block, ns_c = t.shape[1:]
            spec = self.connector._spec
            if (ns_heads, ns_block, ns_c) != (spec.num_kv_heads, self.connector.block_size, 2 * spec.head_size):
                raise KVStoreError("invalid", f"layer {name}: pages {tuple(t.shape[1:])} do not match the namespace "
                                   f"({spec.num_kv_heads}, {self.connector.block_size}, {2 * spec.head_size})")
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), t.device)
        for addr, (nbytes, device) in storages.items():  # vLLM backs every layer with one allocation
            if device.type == "cuda":
                self.agent.register_vram(addr, nbytes, device.index or 0)  # GPU path, not run here
            else:
                self.agent.register_dram(addr, nbytes)
        self.caches = {name: kv_caches[name] for name in names}

    def _page(self, layer: str, block_id: int) -> tuple[int, int]:
        page = self.caches[layer][block_id]
        return page.data_ptr(), page.numel() * page.element_size()

    def _rows(self, layer_index: int, layer: str, items: list[tuple[int, specs.ReplicaLocation]]):
        """(local, remote) rows of one layer for (vLLM block id, replica location) pairs: the page of
        block id in this layer <-> bytes [l x page, (l+1) x page) of the stored block."""
        pages = [(self._page(layer, block_id), location.runs) for block_id, location in items]
        page = pages[0][0][1] if pages else 0
        return slice_rows([(addr, runs) for (addr, _), runs in pages], layer_index * page, (layer_index + 1) * page)

    def _post(self, op: str, layer_index: int, layer: str, items) -> list:
        by_worker: dict[tuple[str, int], list] = {}
        for block_id, location in items:
            by_worker.setdefault((location.worker, location.epoch), []).append((block_id, location))
        mem = "VRAM" if self.caches[layer].is_cuda else "DRAM"
        transfers = []
        for (worker, epoch), group in by_worker.items():
            peer = self.peers.agent_for(worker, epoch)
            local, remote = self._rows(layer_index, layer, group)
            transfers.append(self.agent.submit(op, local, remote, peer, mem, "DRAM") if peer else None)
        return transfers

    # loads

    def start_loads(self, meta: KVStoreConnectorMetadata) -> None:
        """Take a lease on each plan's blocks and post every layer's read; synchronous loads are
        waited for layer by layer in this forward, asynchronous ones polled between steps."""
        for plan in meta.loads:
            try:
                prepared = self.directory.prepare_load(specs.PrepareLoad(
                    namespace_id=meta.namespace_id, hashes=plan.hashes, reader=self.agent.name))
            except KVStoreError as exc:
                log.warning("load of %s failed to start: %s", plan.req_id, exc)
                prepared = specs.LoadPrepared(token=None, expires_at=None, blocks=[])
            load = _Load(plan, prepared.token, prepared.blocks)
            self._load_errors.update(plan.block_ids[len(load.hits):])  # gone since the lookup: recompute
            if load.hits:
                pairs = list(zip(plan.block_ids, (h.location for h in load.hits)))
                load.by_layer = {layer: self._post("READ", i, layer, pairs)
                                 for i, layer in enumerate(self.connector._layer_names)}
            if plan.load_async:
                self._async[plan.req_id] = load
            else:
                self._sync.append(load)

    def wait_layer(self, layer: str) -> None:
        for load in self._sync:
            for transfer in load.by_layer.get(layer, []):
                if transfer is not None:
                    transfer.wait(self.connector.extra.get("timeout_s", 30))

    def async_results(self) -> tuple[set[str], set[str]]:
        finished, failed = set(), set()
        for req_id, load in list(self._async.items()):
            state = load.state()
            if state == "pending":
                continue
            del self._async[req_id]
            finished.add(req_id)
            errors = self._finish_load(load, transfer_failed=state != "done")
            if errors or len(load.hits) < len(load.plan.block_ids):
                failed.add(req_id)
        return finished, failed

    def _finish_load(self, load: _Load, transfer_failed: bool) -> set[int]:
        """Verify a finished load block by block, release its lease; returns the block ids that must
        be recomputed (also kept for get_block_ids_with_load_errors)."""
        reports, bad, errors = [], transfer_failed, set()
        for block_id, hit in zip(load.plan.block_ids, load.hits):
            bad = bad or self._checksum(block_id) != hit.checksum  # a prefix: after one bad block, all
            reports.append(specs.BlockRead(hash=hit.hash, ok=not bad or transfer_failed))
            if bad:
                errors.add(block_id)
        if load.token is not None:
            try:
                self.directory.complete_load(specs.CompleteLoad(token=load.token, blocks=reports))
            except KVStoreError as exc:  # the lease expired: the bytes cannot be vouched for
                log.warning("load of %s refused at completion: %s", load.plan.req_id, exc)
                errors.update(load.plan.block_ids[:len(load.hits)])
        self._load_errors |= errors
        return errors

    def _checksum(self, block_id: int) -> str:
        """xxh3_64 of the stored block: this block's page of every layer, in layer order."""
        hasher = xxhash.xxh3_64()
        for layer in self.connector._layer_names:
            page = self.caches[layer][block_id]
            hasher.update((page.cpu() if page.is_cuda else page).contiguous().view(torch.uint8).numpy())
        return hasher.hexdigest()

    # saves

    def save_layer(self, meta: KVStoreConnectorMetadata, layer: str) -> None:
        if not meta.saves:
            return
        if not self._saves_prepared:  # first layer of the step: reserve every block of every save
            self._saves_prepared = True
            nbytes = sum(self._page(name, 0)[1] for name in self.connector._layer_names)
            for plan in meta.saves:
                try:
                    prepared = self.directory.prepare_store(specs.PrepareStore(
                        namespace_id=meta.namespace_id, writer=self.agent.name, blocks=[
                            specs.BlockToStore(hash=h, parent=p, nbytes=nbytes)
                            for h, p in zip(plan.hashes, [None] + plan.hashes[:-1])]))
                except KVStoreError as exc:
                    log.warning("save of %s skipped: %s", plan.req_id, exc)
                    continue
                admitted = [(plan.block_ids[i], d) for i, d in enumerate(prepared.blocks) if d.status == "admitted"]
                self._saves.append((plan, prepared.token, admitted))
        index = self.connector._layer_names.index(layer)
        for plan, _, admitted in self._saves:
            if admitted:
                self._save_xfers += self._post("WRITE", index, layer, [(b, d.location) for b, d in admitted])

    def finish_step(self) -> None:
        """End of the step: commit this step's saves, verify and release its loads."""
        ok = all(t is not None and t.wait(30) == "done" for t in self._save_xfers)
        for plan, token, admitted in self._saves:
            if not admitted:
                continue
            reports = [specs.BlockWritten(hash=d.hash, ok=ok, checksum=self._checksum(b)) for b, d in admitted]
            try:
                self.directory.complete_store(specs.CompleteStore(token=token, blocks=reports))
            except KVStoreError as exc:
                log.warning("save of %s not committed: %s", plan.req_id, exc)
        self._saves, self._save_xfers, self._saves_prepared = [], [], False
        for load in self._sync:
            timeout = self.connector.extra.get("timeout_s", 30)
            failed = any(t is None or t.wait(timeout) != "done" for ts in load.by_layer.values() for t in ts)
            self._finish_load(load, transfer_failed=failed)
        self._sync = []

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self.peers.close()
        self.agent.close()
