"""Layer-wise loads: every layer's read is posted at once, and each layer is waited for on its
own, so attention over layer l can start while layers l+1.. are still on the wire.

    load = client.start_load_layers(token_ids)   # prepare_load (a lease) + one NIXL READ per layer
    k, v = load.wait_layer(l)                     # [H, n, D] of layer l once its read completed
    n = load.finish()                             # whole-block checksums + complete_load: verified blocks

The store's block layout is layer-major ([L][K,V][T][H][D]), so layer l of a block is one
contiguous slice at l x layer_bytes; a layer's read is one request with a descriptor per block
(split where the block's pages are), or, from the mapped arena of a worker on this host, plain
copies on the copy threads, each block hashed in the arena beside them. A poller thread stamps
each layer's completion, which gives:

    T_post        prepare_load + posting layer 0's read (the poller posts layers 1..)
    T_xfer[l]     post -> completion of layer l
    T_visible[l]  how long wait_layer(l) kept the caller waiting

exported as Prometheus histograms (`kvstore_connector_*_seconds`) and in `timings()`. Bytes
are used before `finish()` verifies them: an engine that sees finish() return fewer blocks than
it consumed must recompute (the same contract as vLLM's load-error reporting).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from prometheus_client import Histogram

from kvstore.connector import layout
from kvstore.connector.layer_copies import COPY_THREADS, POLL_S, HostMemory, by_worker
from kvstore.connector.layer_posts import LayerSide, post_layer
from kvstore.connector.page_checksums import ArenaHashes
from kvstore.core import specs
from kvstore.core.keys import checksum

BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
T_POST = Histogram("kvstore_connector_load_post_seconds", "prepare_load + posting layer 0's read",
                   buckets=BUCKETS)
T_XFER = Histogram("kvstore_connector_layer_xfer_seconds", "post -> completion of one layer's read",
                   buckets=BUCKETS)
T_VISIBLE = Histogram("kvstore_connector_layer_visible_seconds", "time a caller waited for one layer",
                      buckets=BUCKETS)
log = logging.getLogger(__name__)


class LayerClock:
    """Posts the reads of layers 0..n-1 (layer 0 at once, the rest from a helper thread, so the
    caller can start computing) and stamps each layer's completion for T_xfer and T_visible.

        clock = LayerClock(n, post, t0)   # post(layer) -> one transfer per worker (None = failed)
        clock.wait(l)                      # "done" | "failed" once layer l ended
        clock.finish()                     # every layer ended: True if all of them are "done"

    A layer still pending after `timeout_s` counts as failed. Transfers are polled by one thread
    at a time (NIXL's are not safe to poll from two). `finish` also waits for copies on this
    host's copy threads that outlived their layer: they write into the caller's memory."""

    def __init__(self, num_layers: int, post: Callable[[int], list], t0: float, timeout_s: float = 60.0) -> None:
        self._post_fn, self.timeout_s = post, timeout_s
        self.transfers: list[list | None] = [None] * num_layers  # None until the layer's post returned
        self.posted_at: list[float] = [0.0] * num_layers
        self.done_at: list[float | None] = [None] * num_layers
        self.states: list[str] = ["pending"] * num_layers
        self.t_visible: list[float] = [0.0] * num_layers
        self._changed, self._polling = threading.Condition(), threading.Lock()
        self._deadline = time.perf_counter() + timeout_s
        self._first_posted, self._aborted = threading.Event(), False
        # started before layer 0's copies take the cores: a thread's start waits until it runs
        self._poller = threading.Thread(target=self._post_and_poll, name="kvstore-layer-poller", daemon=True)
        self._poller.start()
        try:
            if num_layers:
                self._post(0)  # layer 0 now: the model needs it first; the rest are posted while it computes
        except BaseException:
            self._aborted = True  # the caller sees the error; nothing more is posted for this load
            raise
        finally:
            self._first_posted.set()
        self.t_post = time.perf_counter() - t0
        T_POST.observe(self.t_post)

    def _post(self, layer: int) -> None:
        self.posted_at[layer] = time.perf_counter()
        self.transfers[layer] = self._post_fn(layer)

    def _post_and_poll(self) -> None:
        self._first_posted.wait()
        if self._aborted:
            return
        try:
            for layer in range(1, len(self.transfers)):
                self._post(layer)
                self._poll_once()
        except Exception:  # noqa: BLE001 (the poller must live on: the layers posted still end)
            log.exception("posting a layer's read failed: the layers not posted fail now")
            self._fail_unposted()
        while self._poll_once():
            time.sleep(POLL_S)

    def _fail_unposted(self) -> None:
        """Every layer whose post never returned ends as failed at once, so no caller waits out the
        timeout for a read that was never asked for."""
        with self._changed:
            for i, requests in enumerate(self.transfers):
                if requests is None and self.states[i] == "pending":
                    self.transfers[i], self.done_at[i], self.states[i] = [], time.perf_counter(), "failed"
            self._changed.notify_all()

    def _poll_once(self) -> bool:
        """Stamp the layers whose reads ended; True while some posted layer is still pending."""
        late = time.perf_counter() > self._deadline
        return any([self._stamp(i, late) for i in range(len(self.transfers))])

    def _stamp(self, i: int, late: bool = False) -> bool:
        """Stamp layer i if its reads ended (or it is `late`); True while it is posted and pending."""
        requests = self.transfers[i]
        if self.states[i] != "pending" or requests is None:
            return False
        with self._polling:
            polled = [_polled(t) for t in requests]
        state = "failed" if "failed" in polled else "pending" if "pending" in polled else "done"
        if state == "pending" and not late:
            return True
        with self._changed:
            if self.states[i] == "pending":  # the waiter and the poller may both see it end
                self.done_at[i], self.states[i] = time.perf_counter(), "failed" if state == "pending" else state
                self._changed.notify_all()
        return False

    def state(self) -> str:
        """"pending" while a layer is, else "failed" if any layer failed, else "done"."""
        return "pending" if "pending" in self.states else "failed" if "failed" in self.states else "done"

    def wait(self, layer: int) -> str:
        t0 = time.perf_counter()
        self._stamp(layer)  # a layer already copied is not kept waiting for the poller's turn
        with self._changed:
            self._changed.wait_for(lambda: self.states[layer] != "pending", self.timeout_s)
        self.t_visible[layer] = time.perf_counter() - t0
        T_VISIBLE.observe(self.t_visible[layer])
        return self.states[layer]

    def finish(self) -> bool:
        self._poller.join()  # it returns once every layer is posted and has ended (or timed out)
        for requests in self.transfers:
            for transfer in requests or ():
                settle = getattr(transfer, "settle", None)  # a copy on this host's copy threads
                if settle is not None:
                    settle()
        for layer, done in enumerate(self.done_at):
            if done is not None:
                T_XFER.observe(done - self.posted_at[layer])
        return all(s == "done" for s in self.states)

    def timings(self) -> dict:
        return {"t_post_s": self.t_post,
                "t_xfer_s": [(d - p) if d is not None else None for d, p in zip(self.done_at, self.posted_at)],
                "t_visible_s": list(self.t_visible)}


def _polled(transfer) -> str:
    """A transfer's state; one that cannot say (None: never submitted, or its poll raised) failed."""
    if transfer is None:
        return "failed"
    try:
        return transfer.poll()
    except Exception:  # noqa: BLE001 (a broken transfer fails its layer, never the poller)
        log.exception("polling a layer's read failed")
        return "failed"


class LayerwiseLoad:
    def __init__(self, client, hashes: list[bytes], t0: float) -> None:
        self.client, self.namespace = client, client.namespace
        self.token, self.hits = None, []
        with client.miss_if_refused("load"):  # a directory away or throttling: a miss
            prepared = client.directory.prepare_load(specs.PrepareLoad(
                namespace_id=client.namespace_id, hashes=[h.hex() for h in hashes[: client.slots]],
                reader=client.agent.name))
            self.token, self.hits = prepared.token, prepared.blocks
        self.num_tokens = len(self.hits) * self.namespace.block_tokens
        self._raw = client.staging.view(0, len(self.hits) * self.namespace.block_nbytes)
        self._blocks = layout.block_view(self.namespace, self._raw) if self.hits else None
        self._groups = by_worker([(i, hit.location) for i, hit in enumerate(self.hits)], client.peers.agent_for)
        self._memory, self._hashes = HostMemory(), ArenaHashes(list(range(len(self.hits))), self.namespace.num_layers)
        if self.hits:
            self._memory.add(int(self._raw.ctypes.data), self._raw.nbytes)
        self.clock = LayerClock(self.namespace.num_layers if self.hits else 0, self._post, t0)

    def _post(self, layer: int) -> list:
        """Layer `layer` of every hit block (slot i's at its layer's offset in the staging buffer):
        copied with the arena of a worker on this host when it is mapped (and hashed there), one
        NIXL READ per worker otherwise. Layer 0 copies on one thread: the rest share the cores."""
        size = self.namespace.block_nbytes // self.namespace.num_layers
        side = LayerSide(int(self._raw.ctypes.data) + layer * size, self.namespace.block_nbytes, layer * size,
                         (layer + 1) * size, self._memory)
        transfers, _ = post_layer("READ", self._groups, side, self.client.copier.arenas, self.client.agent,
                                  self.client.copier.pool, self._hashes, layer, self.namespace.num_layers,
                                  1 if layer == 0 else COPY_THREADS)
        return transfers

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) [num_kv_heads, num_tokens, head_dim] of `layer`, or None if its read failed."""
        if not self.hits or self.clock.wait(layer) != "done":
            return None
        n, ns = len(self.hits), self.namespace
        kv = self._blocks[:, layer]  # [n, 2, T, H, D]
        k, v = (kv[:, which].permute(2, 0, 1, 3).reshape(ns.num_kv_heads, n * ns.block_tokens, ns.head_dim)
                for which in (0, 1))
        return k, v

    def finish(self) -> int:
        """Wait for every layer, verify whole blocks, release the lease; returns the verified prefix."""
        if not self.hits:
            return 0
        all_done = self.clock.finish()
        verified, reports = 0, []
        size = self.namespace.block_nbytes
        for i, hit in enumerate(self.hits):
            digest = self._hashes.hexdigest(i) or checksum(self._raw[i * size:(i + 1) * size])
            good = all_done and digest == hit.checksum
            if all_done and not good:  # only a bad block is reported: its replica is invalidated
                reports.append(specs.BlockRead(hash=hit.hash, ok=False))
            verified += good and verified == i
        released = False
        with self.client.miss_if_refused("load"):
            released = self.client.complete_load(specs.CompleteLoad(token=self.token, blocks=reports))
        if not released:
            return 0  # the lease expired under us (or no answer): what was read cannot be vouched for
        return verified

    def timings(self) -> dict:
        return self.clock.timings()
