"""vLLM (>= 0.33) KV connector: vLLM's paged KV cache <-> kvstore, layer by layer.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connector.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"directory_url": "http://127.0.0.1:8700"}}'

Keys are vLLM's own block hashes (`request.block_hashes`, computed by vLLM with its
`prefix_caching_hash_algo` and NONE_HASH), so every engine with the same settings agrees. The
namespace records the hash algorithm, a fingerprint of NONE_HASH, the model, the KV geometry,
the block size and the TP rank; the scheduler sends its id to the workers with each step.

Blocks are stored in vLLM's own page layout, layer-major: block b = the pages kv[l][b] of every
layer l, each [num_kv_heads, block_size, head_size + head_size_v] (`layer_head_token_kvdim`, vLLM's
HND layouts LBHNC and BLHNC) or [block_size, num_kv_heads, ..] (`layer_token_head_kvdim`, NHD:
LBNHC, BLNHC), bytes as they lie in memory; the layout is part of the namespace, so engines with
different layouts never share blocks. A layer's load or save is one request per storage worker,
straight between vLLM's paged buffer and the worker, with no staging copy.

Scheduler side: `get_num_new_matched_tokens` (a lookup: full blocks beyond the local hit,
leaving at least one prompt token to compute), `update_state_after_alloc`,
`get_external_cache_hit_sources` (host / disk / external by tier), `build_connector_meta`
(loads; saves of the prompt blocks each step completes, so a prompt prefilled in chunks is saved
chunk by chunk; preempted requests), `request_finished` (True while saves may be in flight:
vLLM frees the blocks once the worker reports the request in finished_sending).
Worker side (`worker.PagedKVWorker`): `register_kv_caches` (the backing buffer, registered
once), `start_load_kv` (each layer's read posted), `wait_for_layer_load` (that layer only),
`save_kv_layer` (the layer handed to the saver thread), `wait_for_save` (closes the step's saves
without waiting for them; verifies and releases its loads), `handle_preemptions` (waits for the
saves of preempted requests before their blocks are reused), `get_transfer_results`.

Loads finish within the step by default; with `"load_async": true` vLLM schedules the request
only once `get_transfer_results` reports its load finished (failed ones also in
`failed_recving`). `kv_role` splits prefill and decode (`handoff.py`): a kv_producer saves
every prompt block, the last partial one included, commits the request's hand-off once they are
in and never loads; a kv_consumer waits for a request's hand-off (vLLM asks again each step,
other requests go on), loads the whole prompt but its last token and never saves. Refused at start-up: several KV cache groups (hybrid models), MLA and other
non-full attention, K and V of different head sizes, dtypes the store does not name, and
pipeline parallelism. Each TP rank stores its shard under its own namespace (its tp_rank).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, KVConnectorTransferResults,
                                                                SupportsHMA)

from kvstore.client import DirectoryClient
from kvstore.connector.vllm.checks import DTYPES, check_kv_cache_config, page_layout, tp_rank
from kvstore.connector.vllm.handoff import HandoffRoles
from kvstore.connector.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.connector.vllm.worker import BlockPlan, PagedKVWorker
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace

log = logging.getLogger(__name__)
__all__ = ["BlockPlan", "KVStoreConnector", "KVStoreConnectorMetadata"]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    namespace_id: str = ""  # the scheduler's namespace: TP rank 0
    namespace: Namespace | None = None  # each TP rank stores its own shard under this with its tp_rank
    loads: list[BlockPlan] = field(default_factory=list)
    saves: list[BlockPlan] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests whose blocks vLLM freed: flush their saves


@dataclass
class _Tracked:
    """A request the scheduler side saves: its vLLM block ids and how many prompt blocks are handed
    to saves so far."""
    request: Any
    block_ids: list[int]
    saved: int = 0
    saving: bool = False  # a save was scheduled: its blocks may be freed only after finished_sending


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("directory_url"):
            raise KVStoreError("invalid", "kv_connector_extra_config needs directory_url, e.g. "
                               '{"directory_url": "http://127.0.0.1:8700"}')
        hosts = extra.get("hosts", [])
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise KVStoreError("invalid", 'kv_connector_extra_config.hosts must be a list of host names or '
                               'addresses, e.g. ["10.0.0.7"]')
        self._spec = check_kv_cache_config(kv_cache_config)
        page_layout(vllm_config.cache_config.kv_cache_layout)  # one the store can describe, if resolved already
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise KVStoreError("invalid", "KVStoreConnector does not handle pipeline parallelism yet "
                               f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size})")
        self.block_size = vllm_config.cache_config.block_size
        self.hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self.extra = extra
        self.timeout_s = float(extra.get("timeout_s", 30))
        # an engine token and a CA bundle: from the config, else $KVSTORE_TOKEN and $KVSTORE_CA_FILE
        self.directory = DirectoryClient(extra["directory_url"], timeout_s=self.timeout_s, token=extra.get("token"),
                                         ca_file=extra.get("ca_file"))
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._namespace_id: str | None = None
        self._ns: Namespace | None = None
        self._rank_namespaces: dict[str, str] = {}  # scheduler namespace id -> this TP rank's namespace id
        self.tp_rank = tp_rank(extra) if role == KVConnectorRole.WORKER else 0
        # req_id -> (request, first block, hit blocks, the keys looked up)
        self._matched: dict[str, tuple[Any, int, int, list[str]]] = {}
        self._requests: dict[str, Any] = {}  # requests seen by the scheduler side, until scheduled
        self._tracked: dict[str, _Tracked] = {}  # scheduled requests, until finished
        self._sources: dict[str, list[str]] = {}  # req_id -> tier of each matched block
        self._loads: list[BlockPlan] = []
        # req_id -> (first block, vLLM block ids) its load fills: blocks 0..first + len(ids) are in the
        # store, so not saved again; a block that fails to load is cut off with what follows
        self._loaded: dict[str, tuple[int, list[int]]] = {}
        self.load_async = bool(extra.get("load_async", False))
        self._pd = HandoffRoles(self._kv_transfer_config.kv_role, self.directory, self.block_size, self.hash_algo,
                                extra) if role == KVConnectorRole.SCHEDULER else None
        self._partials: list[BlockPlan] = []  # finished hand-off requests' last partial blocks, to save next
        self._worker = None
        if role == KVConnectorRole.WORKER:
            page = (self._spec.num_kv_heads, self.block_size, 2 * self._spec.head_size)
            self._worker = PagedKVWorker(self.directory, self._layer_names, page, self._spec.dtype, self.timeout_s,
                                         hosts=self.extra.get("hosts", []))
        if role == KVConnectorRole.SCHEDULER and self.hash_algo.startswith("xxhash") \
                and os.environ.get("PYTHONHASHSEED") is None:
            log.warning("prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM seeds its block hashes at "
                        "random, so no other engine will ever hit what this one stores; set PYTHONHASHSEED "
                        "to the same value everywhere, or use sha256", self.hash_algo)

    @property
    def requires_kv_delivery(self) -> bool:
        """True for a kv_producer, whose saves are a consumer's hand-off: vLLM recomputes a request
        preempted while they are pending. A cache (kv_both) loses only a future hit to a cut save
        (and handle_preemptions lets the saves finish first)."""
        return self._kv_transfer_config.kv_role == "kv_producer"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: wait_for_layer_load and save_kv_layer run between the layers, which a captured
        full CUDA graph would skip on replay."""
        return True

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
        return Namespace(
            model_id=str(model), model_revision=str(self.extra.get("model_revision", "")),
            tenant=str(self.extra.get("tenant", "")),
            num_layers=len(self._layer_names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            dtype=DTYPES[spec.dtype], block_tokens=self.block_size,
            layout=page_layout(self._vllm_config.cache_config.kv_cache_layout),
            tp_rank=0, tp_size=self._vllm_config.parallel_config.tensor_parallel_size,
            hash_scheme=f"vllm-{self.hash_algo}-none:{xxhash.xxh64_hexdigest(none_hash)}")

    def _namespace_id_now(self) -> str:
        if self._namespace_id is None:
            self._ns = self.namespace()
            self._namespace_id = self.directory.register_namespace(self._ns)
        return self._namespace_id

    def _rank_namespace_id(self, meta: KVStoreConnectorMetadata) -> str:
        """The namespace this TP rank's shard of the KV lives in. The scheduler looks up rank 0's;
        a block another rank lacks is a load error there, and vLLM recomputes it."""
        if self.tp_rank == 0 or meta.namespace is None:
            return meta.namespace_id
        if meta.namespace_id not in self._rank_namespaces:
            self._rank_namespaces[meta.namespace_id] = self.directory.register_namespace(
                dataclasses.replace(meta.namespace, tp_rank=self.tp_rank))
        return self._rank_namespaces[meta.namespace_id]

    # ---- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` the store holds: whole blocks, and never the whole
        prompt (vLLM must compute at least one token). Side-effect free for the store. A request
        that waits for a hand-off answers None (vLLM asks again next step) until it has come."""
        self._requests[request.request_id] = request  # its block hashes are needed again when it is saved
        if not self._pd.loads:
            return 0, False
        keys, limit = self._pd.load_keys(request)
        first = num_computed_tokens // self.block_size
        if len(keys) <= first:
            return 0, False
        try:
            namespace_id = self._namespace_id_now()
            if self._pd.consumed(request) is not None and self._pd.wait(request, namespace_id, keys) is None:
                return None, False
            found = self.directory.lookup(namespace_id, keys)
        except KVStoreError as exc:
            log.warning("lookup for %s failed (%s): computing it", request.request_id, exc)
            return 0, False
        hit = found.num_hit_blocks
        if hit <= first:
            return 0, False
        self._matched[request.request_id] = (request, first, hit, keys)
        self._sources[request.request_id] = found.tiers()[first:hit]
        return min(hit * self.block_size, limit) - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or matched is None:
            return
        _, first, hit, keys = matched
        block_ids = blocks.get_block_ids()[0]
        prompt = len(request.prompt_token_ids or ())
        full = prompt // self.block_size  # a hand-off's partial block is no full one
        # the forward computes the prompt's last token into its block: loaded, that block is checked first
        self._loads.append(BlockPlan(request.request_id, keys[first:hit], list(block_ids[first:hit]),
                                     load_async=self.load_async, partial_tail=hit > (prompt - 1) // self.block_size))
        self._loaded[request.request_id] = (first, list(block_ids[first:min(hit, full)]))

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
        """This step's loads, the saves of the prompt blocks it completes, and its preemptions."""
        meta = KVStoreConnectorMetadata(namespace_id=self._namespace_id_now(), namespace=self._ns,
                                        loads=self._loads, saves=self._partials)
        self._loads, self._partials = [], []
        progress = []  # (tracked, tokens computed once this step ran)
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.pop(new.req_id, None)
            if request is None:
                continue
            first, loaded = self._loaded.pop(new.req_id, (0, []))
            tracked = self._tracked[new.req_id] = _Tracked(request, list(new.block_ids[0]), saved=first + len(loaded))
            progress.append((tracked, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted earlier: vLLM gives the whole list again
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids += new_ids[0]
            progress.append((tracked, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)))
        for tracked, computed in progress if self._pd.saves else ():
            request = tracked.request
            limit = len(request.block_hashes) if self._pd.saves_decode else \
                len(request.prompt_token_ids or ()) // self.block_size
            ready = min(computed // self.block_size, limit, len(tracked.block_ids))
            if ready <= tracked.saved:
                continue
            hashes = [h.hex() for h in request.block_hashes[:ready]]
            meta.saves.append(BlockPlan(request.request_id, hashes[tracked.saved:],
                                        tracked.block_ids[tracked.saved:ready],
                                        parent=hashes[tracked.saved - 1] if tracked.saved else None,
                                        hints=self._pd.hints(request)))
            tracked.saved, tracked.saving = ready, True
        meta.preempted = {r for r in scheduler_output.preempted_req_ids or () if r in self._tracked}
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Requests whose saves are all in commit their hand-offs. Blocks that failed to load are
        recomputed by vLLM: save them (and what follows) again once they are, instead of counting
        them as held by the store."""
        self._pd.sent(connector_output.finished_sending or ())
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for tracked in self._tracked.values():
            bad = [i for i, b in enumerate(tracked.block_ids[:tracked.saved]) if b in invalid]
            if bad:
                tracked.saved = bad[0]
        for req_id, (first, block_ids) in self._loaded.items():  # asynchronous loads not scheduled yet
            bad = [i for i, b in enumerate(block_ids) if b in invalid]
            if bad:
                self._loaded[req_id] = (first, block_ids[:bad[0]])

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """True when a save of this request was scheduled: vLLM then keeps its blocks until the
        worker reports it in finished_sending (once every save of it is committed or failed). A
        hand-off's producer also saves the prompt's partial last block now, and answers what a
        router passes on to the consumer."""
        self._requests.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._loaded.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        saving = tracked is not None and tracked.saving
        handoff = self._pd.produced(request)
        if handoff is None:
            self._pd.forget(request.request_id)
            return saving, None
        num_tokens = tracked.saved * self.block_size if tracked is not None else 0
        partial = self._pd.partial_plan(request, tracked.saved, tracked.block_ids) if tracked else None
        self._pd.forget(request.request_id)
        if partial is not None:
            self._partials.append(partial)
            saving, num_tokens = True, len(request.prompt_token_ids)
        return saving, self._pd.finished(request, handoff, self._namespace_id_now(), num_tokens, saving)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    # ---- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches, page_layout(self._vllm_config.cache_config.kv_cache_layout))

    def handle_preemptions(self, kv_connector_metadata: KVStoreConnectorMetadata) -> None:
        if kv_connector_metadata.preempted:
            self._worker.flush(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._worker.start_loads(self._rank_namespace_id(meta), meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._worker.save_layer(self._rank_namespace_id(meta), meta.saves, layer_name)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        self._worker.finish_step(self._rank_namespace_id(meta), meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves of finished requests that are committed (finished_sending: vLLM frees their blocks),
        and asynchronous loads that ended (a failed one is in finished_recving and failed_recving,
        its blocks in get_block_ids_with_load_errors)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        finished, failed = self._worker.async_results()
        return KVConnectorTransferResults(finished_sending=self._worker.sent(finished_req_ids),
                                          finished_recving=finished, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving), for callers of the older interface; vLLM 0.33 calls
        get_transfer_results, which also carries failed_recving."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_kv_connector_stats(self):
        """This worker's timings since the last step (on the scheduler: its hand-offs' waits and
        commits), for vLLM's logger and /metrics."""
        stats = KVStoreConnectorStats(data=self._worker.take_stats() if self._worker else self._pd.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker else set()

    def shutdown(self) -> None:
        if self._worker:
            self._worker.close()
        if self._pd:
            self._pd.close()
        self.directory.close()
