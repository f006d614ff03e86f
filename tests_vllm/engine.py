"""One engine process: vLLM 0.33's own `Scheduler` (which builds the scheduler half of
KVStoreConnector from a real VllmConfig), the worker half made by `KVConnectorFactory`, and a
stand-in for the model runner that follows vLLM's worker call order and writes each computed
token's KV into a paged buffer in vLLM's per-layer [blocks, heads, block_size, 2 x head] layout.

    python -m tests_vllm.engine --url URL --out R.json [--hash sha256] [--prompts 1]
        [--max-batched-tokens 256] [--hold-blocks 0] [--load-async] [--evict-before-load]
        [--slow-save-s 0] [--wait-saves] [--num-blocks 64] [--max-tokens 2] [--followup 0]
        [--role kv_both|kv_producer|kv_consumer] [--handoff ID] [--handoff-timeout-s S] [--finished-marker F]

With --handoff, request i carries `kv_transfer_params` {"handoff_id": "ID-i"} (and vLLM's
do_remote_decode / do_remote_prefill flags on a kv_both engine, by --handoff-side), as a router
sends them to the prefill and the decode instance. As in vLLM's model runner, a step that
schedules no token runs no forward (the connector then only sees wait_for_save).

The KV of position p in layer l is a function of (l, the tokens up to p), so a page holds the
right values only if the model computed it or the store returned what another engine computed
for the same prefix. When a request finishes (before vLLM frees its blocks) the engine checks
every computed position of every layer. The prompts are the same in every process (fixed
seeds), so engine B hits what engine A saved.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import xxhash

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvstore.client import DirectoryClient  # noqa: E402

MODEL = str(Path(__file__).resolve().parent / "tiny-llama")  # a config.json only: nothing is downloaded
BLOCK, HEADS, HEAD, LAYERS = 16, 2, 8, 4
PROMPT_TOKENS = 16 * 10 + 5  # 10 full blocks and a partial one
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
EOS = 2


def configs(url: str, hash_algo: str = "sha256", load_async: bool = False, max_batched_tokens: int = 256,
            num_blocks: int = 64, role: str = "kv_both", extra: dict | None = None, kv_layout: str | None = None):
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connector.vllm",
                                kv_role=role, kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"directory_url": url, "load_async": load_async,
                                                           **(extra or {})})
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo)
    cache.num_gpu_blocks = num_blocks
    cache.kv_cache_layout = kv_layout  # as resolved by vLLM's engine core (None: not resolved)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_batched_tokens,
                                         max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=cache, kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])
    return vllm_config, kv_cache_config


def prompt(index: int = 0, tokens: int = PROMPT_TOKENS) -> list[int]:
    return torch.randint(3, 30_000, (tokens,), generator=torch.Generator().manual_seed(7 + index)).tolist()


def followup(tokens: list[int], n: int) -> list[int]:
    """`tokens` and the first n tokens generated for them (the stand-in samples 1000 + length)."""
    return tokens + [1000 + len(tokens) + j for j in range(n)]


def prefix_hashes(tokens: list[int]) -> list[int]:
    """h[p] identifies tokens[:p + 1]: the KV of position p depends on exactly these."""
    out, h = [], 0
    for t in tokens:
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + t.to_bytes(4, "little"))
        out.append(h)
    return out


def kv_of(prefix_hash: int, layer: int) -> torch.Tensor:
    """[HEADS, 2 x HEAD]: what the model writes for a position with this prefix in this layer."""
    base = (prefix_hash % 1_000_003) / 1_000_003 + layer
    return torch.arange(HEADS * 2 * HEAD, dtype=torch.float32).view(HEADS, 2 * HEAD) * 1e-3 + base


class Engine:
    def __init__(self, args) -> None:
        hash_fn = get_hash_fn_by_name(args.hash)
        init_none_hash(hash_fn)
        self.hash_fn = hash_fn
        extra = {"handoff_timeout_s": args.handoff_timeout_s} if args.handoff_timeout_s else {}
        if args.tenant:
            extra["tenant"] = args.tenant
        self.vllm_config, kv_cache_config = configs(args.url, args.hash, args.load_async, args.max_batched_tokens,
                                                    args.num_blocks, args.role, extra, args.kv_layout)
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        # one allocation, as vLLM does; each layer seen as [blocks, heads, block size, K|V], stored as the
        # layout says: heads outermost in a page (HND: LBHNC), or tokens (NHD: LBNHC)
        if args.kv_layout == "LBNHC":
            backing = torch.zeros(LAYERS, args.num_blocks, BLOCK, HEADS, 2 * HEAD).transpose(2, 3)
        else:
            backing = torch.zeros(LAYERS, args.num_blocks, HEADS, BLOCK, 2 * HEAD)
        self.kv = {name: backing[i] for i, name in enumerate(LAYER_NAMES)}
        self.worker.register_kv_caches(self.kv)
        if args.hold_blocks:  # another tenant holds these: this engine's requests get other block ids
            self.scheduler.kv_cache_manager.block_pool.get_new_blocks(args.hold_blocks)
        if args.slow_save_s:  # saves stay in flight for this long: the blocks must outlive the request
            save = self.worker._worker._save
            self.worker._worker._save = lambda step: (time.sleep(args.slow_save_s), save(step))
        self.args = args
        self.directory = DirectoryClient(args.url)  # the test's own view of the store
        self.tables: dict[str, list[int]] = {}  # the model runner's block table
        self.seen: dict[str, list[int]] = {}  # every token of each request, as of its last step
        self.report: dict[str, dict] = {}
        self.invalid: set[int] = set()
        self.recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.preempted: set[str] = set()
        self.steps = 0
        self.step_log: list[dict] = []  # per step: time inside the worker half's hooks, saves, loads
        self._hook_s = 0.0
        self._spy_on_the_scheduler_half()
        self._time_the_worker_hooks()
        # what vLLM's front end does with the stats the scheduler returns: a log line and /metrics
        self.front_prom = KVConnectorProm(self.vllm_config, ["model_name", "engine"], {0: ["contract", "0"]})
        self.front_log = KVConnectorLogging(self.vllm_config.kv_transfer_config)
        self.logged: list[str] = []

    def _spy_on_the_scheduler_half(self) -> None:
        """Record what the connector answered vLLM (the calls still go to it unchanged)."""
        connector = self.scheduler.connector
        matched, sources = connector.get_num_new_matched_tokens, connector.get_external_cache_hit_sources
        finished, resolve = connector.request_finished, connector._pd._resolve

        def get_num_new_matched_tokens(request, num_computed_tokens):
            answer = matched(request, num_computed_tokens)
            report = self.report[request.request_id]
            if answer[0] is None:  # waiting for its hand-off: asked again next step
                report["asked_while_waiting"] = report.get("asked_while_waiting", 0) + 1
                report.setdefault("waiting_since", time.time())
            else:
                report.setdefault("matched", list(answer))
            return answer

        def request_finished(request, block_ids):
            answer = finished(request, block_ids)
            self.report[request.request_id]["kv_transfer_params"] = answer[1]
            return answer

        def resolved(req_id, result):
            self.report[req_id]["handoff"] = {"outcome": result.outcome, "waited_s": result.waited_s}
            return resolve(req_id, result)

        def get_external_cache_hit_sources(request, num_external_tokens):
            answer = sources(request, num_external_tokens)
            self.report[request.request_id]["sources"] = {str(k.value): v for k, v in answer.items()}
            return answer

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.get_external_cache_hit_sources = get_external_cache_hit_sources
        connector.request_finished = request_finished
        connector._pd._resolve = resolved

    def _time_the_worker_hooks(self) -> None:
        """Add up the time each step spends inside the worker half (what the forward waits for)."""
        for name in ("handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_transfer_results", "get_block_ids_with_load_errors"):
            def timed(*args, _hook=getattr(self.worker, name), **kwargs):
                t0 = time.perf_counter()
                try:
                    return _hook(*args, **kwargs)
                finally:
                    self._hook_s += time.perf_counter() - t0
            setattr(self.worker, name, timed)

    def add(self, req_id: str, tokens: list[int]) -> None:
        extra = None
        index = int(req_id.removeprefix("req-"))
        if self.args.handoff and index < self.args.handoff_only:
            handoff = {"handoff_id": f"{self.args.handoff}-{index}", **json.loads(self.args.handoff_params)}
            if self.args.handoff_side:  # a kv_both engine: vLLM's flags say which side this is
                flag = {"producer": "do_remote_decode", "consumer": "do_remote_prefill"}[self.args.handoff_side]
                handoff[flag] = True
            extra = {"kv_transfer_params": handoff}
        params = SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True, extra_args=extra)
        params.update_from_generation_config({}, EOS)
        request = Request(req_id, tokens, params, None, block_hasher=get_request_block_hasher(BLOCK, self.hash_fn))
        self.report[req_id] = {"computed_prompt_tokens": 0, "sources": {}, "keys": [h.hex() for h in request.block_hashes]}
        self.scheduler.add_request(request)

    def step(self) -> None:
        self.steps += 1
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.preempted |= set(out.preempted_req_ids or ())
        for plan in meta.loads:  # the vLLM block ids each load writes into
            self.report[plan.req_id].setdefault("load_block_ids", plan.block_ids)
        if self.args.evict_before_load and meta.loads:  # the blocks go between the lookup and the load
            self.directory.evict(meta.namespace_id)
        for req_id in out.preempted_req_ids or ():  # vLLM freed its blocks: its saves must end first
            self.report[req_id]["saves_in_flight_at_preemption"] = self.worker._worker._pending.get(req_id, 0)
        self.worker.handle_preemptions(meta)
        for req_id in out.preempted_req_ids or ():
            self.report[req_id]["store_hits_after_flush"] = self._store_hits(req_id)
        self.worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            self.worker.start_load_kv(None)
        computed = self._update_tables(out)
        for layer, name in enumerate(LAYER_NAMES if out.total_num_scheduled_tokens else ()):  # the forward
            self.worker.wait_for_layer_load(name)
            for req_id, n in out.num_scheduled_tokens.items():
                self._write(req_id, layer, computed[req_id], n)
            self.worker.save_kv_layer(name, self.kv[name], None)
        if not out.has_sync_kv_loads:
            self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        if self.args.wait_saves:  # synchronous saves: the step ends once its saves are committed
            t0 = time.perf_counter()
            self.worker._worker.flush(set(self.worker._worker._pending))
            self._hook_s += time.perf_counter() - t0
        results = self.worker.get_transfer_results(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.invalid |= invalid
        self.step_log.append({"hook_s": self._hook_s, "saves": len(meta.saves), "loads": len(meta.loads),
                              "tokens": out.total_num_scheduled_tokens})
        self._hook_s = 0.0
        self.recving |= results.finished_recving
        self.failed_recving |= results.failed_recving
        for req_id in results.finished_sending:
            self._at_free(req_id)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = computed[req_id] + out.num_scheduled_tokens[req_id] >= request.num_tokens
            sampled.append([1000 + request.num_tokens] if done else [])  # a partial prefill samples nothing
            self.seen[req_id] = list(request.all_token_ids) + sampled[-1]
            end = min(request.num_prompt_tokens, computed[req_id] + out.num_scheduled_tokens[req_id])
            self.report[req_id]["computed_prompt_tokens"] += max(0, end - computed[req_id])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, invalid_block_ids=invalid,
                kv_connector_stats=self.worker.get_kv_connector_stats()))
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.front_prom.observe(stats.kv_connector_stats, 0)
                self.front_log.observe(stats.kv_connector_stats)
        for req_id, report in self.report.items():
            request = self.scheduler.requests.get(req_id)
            if "finished_step" not in report and (request is None or RequestStatus.is_finished(request.status)):
                report["finished_step"] = self.steps
                report["finished_at"] = time.time()
                if self.args.finished_marker:
                    Path(self.args.finished_marker).write_text(req_id)
                report["kv_exact"] = self._check(req_id)
                report["block_ids"] = self.tables[req_id]
                if request is not None:  # still held (its saves run): every full block's key, outputs too
                    report["all_keys"] = [h.hex() for h in request.block_hashes]
            if "freed_step" not in report and request is None:
                report["freed_step"] = self.steps
        if not out.num_scheduled_tokens:
            time.sleep(0.01)  # waiting for transfers: do not spin

    def _update_tables(self, out) -> dict[str, int]:
        """vLLM's model runner bookkeeping: block table and computed tokens of each scheduled request."""
        computed = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            self.report[new.req_id].setdefault("first_block_ids", list(new.block_ids[0]))
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self.tables[req_id] += new_ids[0]
            computed[req_id] = cached.num_computed_tokens[i]
        return computed

    def _write(self, req_id: str, layer: int, start: int, n: int) -> None:
        """This step's positions of one layer. Like attention, the result depends on the KV already in
        the pages: if the position before `start` does not hold its KV (a load that failed), what
        is written is wrong too."""
        tokens = self.scheduler.requests[req_id].all_token_ids
        hashes, table, page = prefix_hashes(tokens[:start + n]), self.tables[req_id], self.kv[LAYER_NAMES[layer]]
        context_ok = start == 0 or torch.equal(page[table[(start - 1) // BLOCK], :, (start - 1) % BLOCK],
                                               kv_of(hashes[start - 1], layer))
        for p in range(start, start + n):
            page[table[p // BLOCK], :, p % BLOCK] = kv_of(hashes[p], layer) + (0.0 if context_ok else 1000.0)

    def _check(self, req_id: str) -> bool:
        """Every computed position of every layer holds the KV of its prefix (read before any reuse)."""
        tokens = self.seen[req_id][:-1]  # the last one was sampled, not computed
        hashes, table = prefix_hashes(tokens), self.tables[req_id]
        return all(torch.equal(self.kv[name][table[p // BLOCK], :, p % BLOCK], kv_of(hashes[p], layer))
                   for layer, name in enumerate(LAYER_NAMES) for p in range(len(tokens)))

    def _at_free(self, req_id: str) -> None:
        """finished_sending: vLLM is about to free the blocks; the store must hold them by now."""
        self.report[req_id]["sent_step"] = self.steps
        self.report[req_id]["store_hits_at_free"] = self._store_hits(req_id)

    def _store_hits(self, req_id: str) -> int:
        """How many of the prompt's full blocks the store holds, as a prefix."""
        namespace_id = self.scheduler.connector._namespace_id_now()
        full = len(self._tokens[req_id]) // BLOCK
        return self.directory.lookup(namespace_id, self.report[req_id]["keys"][:full]).num_hit_blocks

    def run(self, prompts: list[list[int]], timeout_s: float = 120) -> dict:
        self._tokens = {f"req-{i}": tokens for i, tokens in enumerate(prompts)}
        for req_id, tokens in self._tokens.items():
            self.add(req_id, tokens)
        deadline = time.monotonic() + timeout_s
        while self.scheduler.requests and time.monotonic() < deadline:
            self.step()
        self.scheduler.connector._pd.flush()  # hand-off commits still on their way: their timings too
        last = self.scheduler.connector.get_kv_connector_stats()
        if last is not None:
            self.front_log.observe(last.data)
        from prometheus_client import REGISTRY

        histograms = {name: REGISTRY.get_sample_value(f"kvstore_connector_{name}_seconds_count") or 0
                      for name in ("load_post", "layer_xfer", "layer_visible", "save")}
        sums = {name: REGISTRY.get_sample_value(f"kvstore_connector_{name}_seconds_sum") or 0.0
                for name in ("load_post", "layer_xfer", "layer_visible", "save")}
        self.front_log.log(log_fn=lambda fmt, *args: self.logged.append(fmt % args))
        vllm_metrics = {name: REGISTRY.get_sample_value(f"vllm:kvstore_{name}_seconds_count",
                                                        {"model_name": "contract", "engine": "0"}) or 0
                        for name in ("load_post", "layer_xfer", "layer_visible", "save")}
        return {"requests": self.report, "steps": self.steps, "load_errors": sorted(self.invalid),
                "histogram_counts": histograms, "histogram_sums": sums, "step_log": self.step_log,
                "vllm_metric_counts": vllm_metrics, "vllm_log": self.logged,
                "finished_recving": sorted(self.recving), "failed_recving": sorted(self.failed_recving),
                "preempted": sorted(self.preempted), "unfreed": sorted(self.scheduler.requests),
                "namespace_id": self.scheduler.connector._namespace_id_now(),
                "posts": dict(self.worker._worker.posts)}

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()
        self.directory.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hash", default="sha256")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--max-batched-tokens", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--hold-blocks", type=int, default=0)
    parser.add_argument("--load-async", action="store_true")
    parser.add_argument("--evict-before-load", action="store_true")
    parser.add_argument("--slow-save-s", type=float, default=0.0)
    parser.add_argument("--wait-saves", action="store_true")
    parser.add_argument("--role", default="kv_both", choices=["kv_both", "kv_producer", "kv_consumer"])
    parser.add_argument("--handoff", default="", help="request i carries hand-off id ID-i")
    parser.add_argument("--handoff-side", choices=["producer", "consumer"], help="on a kv_both engine")
    parser.add_argument("--handoff-timeout-s", type=float, default=0.0)
    parser.add_argument("--handoff-only", type=int, default=1 << 30, help="only the first N requests hand off")
    parser.add_argument("--handoff-params", default="{}", help="more kv_transfer_params (JSON), as a router adds")
    parser.add_argument("--prompt-seed-offset", type=int, default=0, help="request i gets prompt i + this")
    parser.add_argument("--tenant", default="", help="the namespace's tenant (another namespace)")
    parser.add_argument("--same-host", default="auto", choices=["auto", "off"], help="KVSTORE_SAME_HOST")
    parser.add_argument("--kv-layout", choices=["LBHNC", "LBNHC"], help="vLLM's resolved KV cache layout")
    parser.add_argument("--finished-marker", default="", help="a file written when a request finishes")
    parser.add_argument("--followup", type=int, default=0,
                        help="the next turn: each prompt followed by the first N tokens this engine generates for it")
    args = parser.parse_args()
    os.environ["KVSTORE_SAME_HOST"] = args.same_host
    engine = Engine(args)
    result = engine.run([followup(prompt(i + args.prompt_seed_offset, args.prompt_tokens), args.followup)
                         for i in range(args.prompts)])
    engine.close()
    with open(args.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it


if __name__ == "__main__":
    main()
