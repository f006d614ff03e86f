"""The worker half of the vLLM connector: vLLM's paged KV buffer <-> the storage workers, one
request per (layer, storage worker), no staging copy: plain copies with the DRAM arena of a worker
on this host (by the GPU for GPU pages; KVSTORE_SAME_HOST=off turns it off), NIXL otherwise. It imports nothing
from vLLM; `kvstore.connector.vllm` hands it plain plans.

Loads. `start_loads` leases the step's synchronous loads in one directory call (asynchronous ones
one by one) and posts their reads layer by layer through a `LayerClock` (T_post, T_xfer and
T_visible). `wait_layer` waits for one layer of this step's synchronous loads; `finish_step`
verifies them (whole-block checksums: a block that did not arrive intact is a load error) and
releases their lease; asynchronous loads are polled between steps by `async_results`.

Saves are asynchronous. `save_layer` hands the layer to the saver thread, which reserves the
step's blocks (one prepare_store per request), posts each layer's writes once that layer's KV is
in the page (a CUDA event on GPUs), waits for them, checksums the whole blocks and commits. The
forward never waits for the store: vLLM keeps the blocks until `sent()` reports the request, and
`flush()` waits for the saves of preempted requests before their blocks can be reused.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from prometheus_client import Histogram

from kvstore.client import DirectoryClient
from kvstore.connector.arenas import LocalArenas
from kvstore.connector.layer_copies import COPY_THREADS, BlockGroup, HostMemory, by_worker
from kvstore.connector.layer_posts import LayerSide, post_layer
from kvstore.connector.layerwise import BUCKETS, LayerClock
from kvstore.connector.page_checksums import ArenaHashes, LayerwiseChecksum, checksums, saved_checksums
from kvstore.connector.peers import Peers, own_hosts
from kvstore.connector.renewal import Renewal
from kvstore.connector.vllm.checks import checked_pages
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import VLLM_LAYOUTS
from kvstore.transfer import Agent

log = logging.getLogger(__name__)
STAT_SERIES = ("load_post_s", "layer_xfer_s", "layer_visible_s", "save_s")
T_SAVE = Histogram("kvstore_connector_save_seconds", "a step's saves: first layer handed over -> committed",
                   buckets=BUCKETS)


@dataclass
class BlockPlan:
    """Blocks of one request to move: store keys (hex) and the vLLM block ids they map to."""
    req_id: str
    hashes: list[str]
    block_ids: list[int]
    parent: str | None = None  # the stored block before hashes[0], for a prompt saved over several steps
    load_async: bool = False  # a load vLLM does not wait for in the forward (get_transfer_results)
    partial_tail: bool = False  # the last block holds the prompt's last token: the forward writes into it
    hints: dict | None = None  # what the request says for the store's policies (specs.RequestHints' fields)


@dataclass
class _Load:
    plan: BlockPlan
    token: str | None
    hits: list[specs.BlockHit]
    clock: LayerClock | None = None
    tail: LayerwiseChecksum | None = None  # a partial last block's, layer by layer as each arrives
    hashes: ArenaHashes | None = None  # blocks copied with a mapped arena, hashed there (same host)


@dataclass
class _SaveStep:
    """One engine step's saves; the layers arrive as the forward computes them."""
    namespace_id: str
    plans: list[BlockPlan]
    layers: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # (index, event|None), then None
    started: float = field(default_factory=time.perf_counter)
    failed_loads: set[str] = field(default_factory=set)  # requests whose load in this step failed
    handed: int = 0  # layers the forward handed over


class PagedKVWorker:
    def __init__(self, directory: DirectoryClient, layer_names: list[str], page_shape: tuple[int, int, int],
                 dtype: torch.dtype, timeout_s: float = 30.0, hosts: list[str] | None = None) -> None:
        self.directory, self.layer_names, self.page_shape, self.dtype = directory, layer_names, page_shape, dtype
        self.hosts = own_hosts(hosts or ())  # saves prefer a worker on this host
        self.timeout_s = timeout_s
        self.agent = Agent(f"vllm-kvstore-{uuid.uuid4().hex[:12]}", backends={"UCX": {}})
        self.peers = Peers(self.agent, directory)
        self.caches: dict[str, torch.Tensor] = {}
        self.arenas, self.memory = LocalArenas(), HostMemory()
        self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvstore-copy")  # same-host copies
        self.posts = {"local": 0, "nixl": 0}  # requests per layer and storage worker, by path
        self._after: torch.cuda.Event | None = None  # this step's loads start after it (GPU pages)
        self._load_errors: set[int] = set()
        self._sync: list[_Load] = []  # loads of this forward
        self._async: dict[str, _Load] = {}  # req_id -> a load vLLM polls for between steps
        self._step: _SaveStep | None = None  # this step's saves, once the first layer arrived
        self._pending: dict[str, int] = {}  # req_id -> save steps not yet committed (0: all done)
        self._finished: set[str] = set()  # requests vLLM finished whose blocks wait for their saves
        self._saved = threading.Condition()
        self._saves: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: dict[str, list[float]] = {k: [] for k in STAT_SERIES}  # since take_stats(), for vLLM
        self._stats_lock = threading.Lock()
        self._saver = threading.Thread(target=self._run_saves, name="kvstore-saver", daemon=True)
        self._saver.start()

    def register(self, kv_caches: dict[str, torch.Tensor], layout: str = VLLM_LAYOUTS[0]) -> None:
        """Register vLLM's pages' allocation once; refuse pages `layout` (HND, NHD) does not describe."""
        storages = checked_pages(kv_caches, self.layer_names, self.page_shape, self.dtype, layout)
        for addr, (nbytes, device) in storages.items():  # vLLM backs every layer with one allocation
            if device.type == "cuda":
                self.agent.register_vram(addr, nbytes, device.index or 0)
            else:
                self.agent.register_dram(addr, nbytes)
                self.memory.add(addr, nbytes)
        self.caches = {name: kv_caches[name] for name in self.layer_names}

    def _post(self, op: str, layer_index: int, groups: list[BlockGroup], hashes: ArenaHashes | None) -> list:
        """One request per worker and tier moving layer l's page of every block (bytes [l x page, (l+1) x page) of
        it): a copy with the worker's arena mapped here (copy threads; the GPU for GPU pages), else NIXL."""
        cache = self.caches[self.layer_names[layer_index]]  # block b's page: base + b x step
        page = cache[0].nbytes
        side = LayerSide(cache.data_ptr(), cache.stride(0) * cache.element_size(), layer_index * page,
                         (layer_index + 1) * page, self.memory, cache if cache.is_cuda else None)
        transfers, local = post_layer(op, groups, side, self.arenas, self.agent, self._pool, hashes, layer_index,
                                      len(self.layer_names), after=self._after)
        self.posts["local"] += local
        self.posts["nixl"] += len(groups) - local
        return transfers

    def start_loads(self, namespace_id: str, plans: list[BlockPlan]) -> None:
        """Lease the plans' blocks and post their reads, layer 0 first. The step's synchronous loads
        share one lease (one directory call), waited for layer by layer in this forward;
        asynchronous ones get a lease each, as they finish at different steps. GPU copies into the
        pages wait for what the engine's stream has queued by now (`_after`)."""
        sync, self._after = [p for p in plans if not p.load_async], self._written()
        if sync:
            self._sync += self._start(namespace_id, sync)
        for plan in plans:
            if plan.load_async:
                self._async[plan.req_id] = self._start(namespace_id, [plan])[0]

    def _start(self, namespace_id: str, plans: list[BlockPlan]) -> list[_Load]:
        t0 = time.perf_counter()
        try:
            prepared = self.directory.prepare_loads(specs.PrepareLoads(
                namespace_id=namespace_id, chains=[p.hashes for p in plans], reader=self.agent.name))
        except KVStoreError as exc:
            log.warning("loads of %s failed to start: %s", [p.req_id for p in plans], exc)
            prepared = specs.LoadsPrepared(token=None, expires_at=None, chains=[[] for _ in plans])
        loads = []
        for plan, hits in zip(plans, prepared.chains):
            load = _Load(plan, prepared.token, hits, hashes=ArenaHashes(plan.block_ids, len(self.layer_names)))
            if hits:
                groups = by_worker(list(zip(plan.block_ids, (h.location for h in hits))), self.peers.agent_for)
                load.clock = LayerClock(len(self.layer_names), lambda i, g=groups, h=load.hashes:
                                        self._post("READ", i, g, h), t0, self.timeout_s)
            loads.append(load)
        return loads

    def wait_layer(self, layer: str) -> None:
        """Wait for this layer of the step's synchronous loads. A partial last block is hashed now,
        before the forward writes the rest of its page (a hand-off's consumer computes the prompt's
        last token into it): after the forward its page is no longer what was stored."""
        index = self.layer_names.index(layer)
        for load in self._sync:
            if load.clock is not None:
                load.clock.wait(index)
                if load.plan.partial_tail and len(load.hits) == len(load.plan.block_ids):
                    load.tail = load.tail or LayerwiseChecksum(len(self.layer_names))
                    load.tail.add(index, self.caches[layer][load.plan.block_ids[-1]])

    def async_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) asynchronous loads since the last call; failed ones are in both."""
        finished, failed = set(), set()
        for req_id, load in list(self._async.items()):
            if load.clock is not None and load.clock.state() == "pending":
                continue
            del self._async[req_id]
            finished.add(req_id)
            if self._finish_loads([load])[req_id]:
                failed.add(req_id)
        return finished, failed

    def _observe(self, series: str, values: list[float]) -> None:
        with self._stats_lock:
            self._stats[series] += values

    def take_stats(self) -> dict[str, list[float]]:
        """The timings observed since the last call (vLLM ships them to its logger and /metrics)."""
        with self._stats_lock:
            stats, self._stats = self._stats, {k: [] for k in STAT_SERIES}
        return stats

    def _verify(self, load: _Load) -> tuple[list[specs.BlockRead], set[int]]:
        """(what to tell the directory, block ids vLLM must recompute) for a finished load."""
        transfer_failed = load.clock is not None and not load.clock.finish()
        if load.clock is not None:
            timings = load.clock.timings()
            self._observe("load_post_s", [timings["t_post_s"]])
            self._observe("layer_xfer_s", [t for t in timings["t_xfer_s"] if t is not None])
            if not load.plan.load_async:  # nobody waits per layer for an asynchronous load
                self._observe("layer_visible_s", timings["t_visible_s"])
        loaded = load.plan.block_ids[:len(load.hits)]
        errors = set(load.plan.block_ids[len(load.hits):])  # gone from the store since the lookup
        if transfer_failed:  # the bytes say nothing about the stored blocks: recompute all, blame none
            return [], errors | set(loaded)
        reports, bad = [], False  # only bad blocks are reported: their replicas are invalidated
        # a partial last block was hashed as each layer arrived: its page holds the forward's writes now
        tail = load.plan.partial_tail and not load.plan.load_async and loaded == load.plan.block_ids
        sums = checksums(self.caches, self.layer_names, loaded[:-1] if tail else loaded, load.hashes)
        if tail:
            sums.append(load.hashes.hexdigest(loaded[-1]) or (load.tail.hexdigest() if load.tail else None))
        for block_id, hit, checksum in zip(loaded, load.hits, sums):
            if checksum is not None and checksum != hit.checksum:
                reports.append(specs.BlockRead(hash=hit.hash, ok=False))
            bad = bad or checksum != hit.checksum  # vLLM recomputes from the first bad block on
            if bad:
                errors.add(block_id)
        return reports, errors

    def _finish_loads(self, loads: list[_Load]) -> dict[str, set[int]]:
        """Verify loads that share one lease and release it; the block ids each request must
        recompute (also kept for get_block_ids_with_load_errors)."""
        reports, errors = [], {}
        for load in loads:
            read, errors[load.plan.req_id] = self._verify(load)
            reports += read
        token = loads[0].token if loads else None
        if token is not None:
            try:
                self.directory.complete_load(specs.CompleteLoad(token=token, blocks=reports))
            except KVStoreError as exc:  # the lease expired: the bytes cannot be vouched for
                log.warning("loads of %s refused at completion: %s", list(errors), exc)
                for load in loads:
                    errors[load.plan.req_id] |= set(load.plan.block_ids[:len(load.hits)])
        for bad in errors.values():
            self._load_errors |= bad
        return errors

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _save_step(self, namespace_id: str, plans: list[BlockPlan]) -> _SaveStep | None:
        """This step's saves, handed to the saver thread when first needed."""
        if self._step is None and plans:
            self._step = _SaveStep(namespace_id, plans)
            with self._saved:
                for plan in plans:
                    self._pending[plan.req_id] = self._pending.get(plan.req_id, 0) + 1
            self._saves.put(self._step)
        return self._step

    def save_layer(self, namespace_id: str, plans: list[BlockPlan], layer: str) -> None:
        step = self._save_step(namespace_id, plans)
        if step is None:
            return
        step.handed += 1
        step.layers.put((self.layer_names.index(layer), self._written()))

    def _written(self):
        """An event for what the stream has written by now (GPU pages): saves and loads wait for it."""
        if not self.caches[self.layer_names[0]].is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def finish_step(self, namespace_id: str, plans: list[BlockPlan]) -> None:
        """End of the step: verify and release its synchronous loads; close its saves (they finish
        on the saver thread). A request whose load failed computed this step's blocks over bad KV:
        its saves of this step are not committed. A step without a forward (vLLM's when nothing
        is scheduled) saves blocks computed earlier, every layer at once (a producer's last
        partial block)."""
        failed = {req_id for req_id, bad in self._finish_loads(self._sync).items() if bad}
        self._sync = []
        step = self._save_step(namespace_id, plans)
        if step is not None:
            step.failed_loads = failed
            if step.handed == 0:
                written = self._written()
                for index in range(len(self.layer_names)):
                    step.layers.put((index, written))
            step.layers.put(None)
            self._step = None

    def _run_saves(self) -> None:
        while (step := self._saves.get()) is not None:
            try:
                self._save(step)
            except Exception:  # a save is best effort: never lose the thread (the blocks stay unsaved)
                log.exception("save of %s failed", [p.req_id for p in step.plans])
            finally:
                with self._saved:
                    for plan in step.plans:
                        self._pending[plan.req_id] -= 1
                    self._saved.notify_all()

    def _reserve(self, namespace_id: str, plan: BlockPlan):
        nbytes = sum(self.caches[name][0].nbytes for name in self.layer_names)
        parents = [plan.parent] + plan.hashes[:-1]
        try:
            prepared = self.directory.prepare_store(specs.PrepareStore(
                namespace_id=namespace_id, writer=self.agent.name, hosts=self.hosts, hints=plan.hints,
                blocks=[specs.BlockToStore(hash=h, parent=p, nbytes=nbytes) for h, p in zip(plan.hashes, parents)]))
        except KVStoreError as exc:
            log.warning("save of %s skipped: %s", plan.req_id, exc)
            return None
        admitted = [(plan.block_ids[i], d) for i, d in enumerate(prepared.blocks) if d.status == "admitted"]
        return prepared, admitted

    def _save(self, step: _SaveStep) -> None:
        reserved = [(plan, *r) for plan in step.plans if (r := self._reserve(step.namespace_id, plan)) and r[1]]
        groups = by_worker([(b, d.location) for _, _, admitted in reserved for b, d in admitted], self.peers.agent_for)
        transfers, posted = [], 0
        with contextlib.ExitStack() as renewals:
            for _, prepared, _ in reserved:
                ttl_s = prepared.expires_at - time.time() if prepared.expires_at else 0.0
                renewals.enter_context(Renewal(self.directory, prepared.token if ttl_s > 0 else None, ttl_s))
            while True:
                try:
                    item = step.layers.get(timeout=self.timeout_s)
                except queue.Empty:
                    break  # the step never ended (the engine is gone): nothing is committed
                if item is None:
                    break
                index, event = item
                if event is not None:
                    event.synchronize()
                posted += 1
                if groups:
                    transfers += self._post("WRITE", index, groups, None)
            ok = posted == len(self.layer_names) and all(t and t.wait(self.timeout_s) == "done" for t in transfers)
            for late in [t for t in transfers if hasattr(t, "settle")]:  # none may write once the pages go
                late.settle()
            for plan, prepared, admitted in reserved:
                good = ok and plan.req_id not in step.failed_loads
                sums = self._saved_sums([b for b, _ in admitted]) if good else [None] * len(admitted)
                reports = [specs.BlockWritten(hash=d.hash, ok=good, checksum=checksum)
                           for (_, d), checksum in zip(admitted, sums)]
                try:
                    self.directory.complete_store(specs.CompleteStore(token=prepared.token, blocks=reports))
                except KVStoreError as exc:
                    log.warning("save not committed: %s", exc)
        elapsed = time.perf_counter() - step.started
        T_SAVE.observe(elapsed)
        self._observe("save_s", [elapsed])

    def _saved_sums(self, block_ids: list[int]) -> list[str]:
        """What the save meant to write, hashed from vLLM's pages (unchanged until the save is
        committed: vLLM frees them only once `sent` says so), never from the arena."""
        return saved_checksums(self.caches, self.layer_names, block_ids, self.memory, self._pool, COPY_THREADS)

    def sent(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished (now or earlier) whose saves are all committed: their blocks can go."""
        with self._saved:
            self._finished |= {r for r in finished_req_ids if r in self._pending}
            done = {r for r in self._finished if self._pending[r] == 0}
            for req_id in done:
                del self._pending[req_id]
            self._finished -= done
        return done

    def flush(self, req_ids: set[str]) -> None:
        """Wait for the saves of these requests (preempted: vLLM is about to reuse their blocks)."""
        with self._saved:
            self._saved.wait_for(lambda: all(self._pending.get(r, 0) == 0 for r in req_ids), self.timeout_s * 2)

    def close(self) -> None:
        self._saves.put(None)
        self._saver.join(self.timeout_s * 2)
        self._pool.shutdown(wait=True)
        self.peers.close()
        self.arenas.close()
        self.agent.close()
