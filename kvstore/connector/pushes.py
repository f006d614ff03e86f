"""Loads that storage workers push into this engine's memory (`kvstore.core.push`).

    pusher = Pusher(agent, tenant, mode, hosts, timeout_s, ca_file)
    pusher.asks()                               # whether prepare_load should ask for grants
    done, rest = pusher.push(prepared, items)   # per item pushed?; the indices left for NIXL READs
    pusher.memory_changed()                     # after registering memory: workers get the new metadata
    pusher.forget()                             # before releasing memory: no push lands in it any more

Which loads are pushed (`mode`, $KVSTORE_LOAD_PUSH): "on" every DRAM hit a worker was granted;
"off" none (the engine READs); "auto" (the default) those of workers on other hosts when this host
has no RDMA device: UCX then runs over TCP, where a one-sided READ moved a third of a WRITE's
bytes a second. A push that fails (a worker unreachable, a grant expired) is read instead, so a
load never depends on it; every block is hashed by this engine after it arrived either way.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np
from prometheus_client import Counter as PromCounter

from kvstore.client.http import JsonHttp
from kvstore.core import push, specs
from kvstore.core.errors import KVStoreError
from kvstore.transfer import Agent

log = logging.getLogger(__name__)
PUSHES = PromCounter("kvstore_connector_pushed_blocks_total", "blocks of loads this engine asked workers to push: "
                     "pushed, or failed (and then read)", ["outcome"])
MODES = ("auto", "on", "off")
HTTP_MARGIN_S = 5.0  # a push's answer may take this much longer than the push itself
FORGET_TIMEOUT_S = push.MAX_WAIT_S + 2 * HTTP_MARGIN_S  # a worker waits for running pushes before it answers


class Pusher:
    def __init__(self, agent: Agent, tenant: str, mode: str | None, hosts: Sequence[str], timeout_s: float,
                 ca_file: str | None = None) -> None:
        mode = mode or os.environ.get("KVSTORE_LOAD_PUSH") or "auto"
        if mode not in MODES:
            raise KVStoreError("invalid", f"load push mode {mode!r}: one of {', '.join(MODES)}", mode=mode)
        self.agent, self.tenant, self.mode, self.hosts = agent, tenant, mode, set(hosts)
        self.timeout_s, self.ca_file = timeout_s, ca_file
        self.rdma = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
        self.generation = 0
        self._sent: dict[str, int] = {}  # worker -> generation whose metadata it has
        self._keys: dict[str, tuple[str, int, str, str]] = {}  # worker -> (url, epoch, owner, engine key) asked
        self._clients: dict[str, JsonHttp] = {}
        self._lock = threading.Lock()
        self._old_directory = False
        self._no_push: set[tuple[str, int]] = set()  # (worker, epoch) that answered it has no push route
        self.pushed = self.read = self.failed = 0  # blocks since the start: pushed, read, whose push failed

    def asks(self) -> bool:
        return not self._old_directory and (self.mode == "on" or (self.mode == "auto" and not self.rdma))

    def directory_refused(self) -> None:
        """The directory does not know pushed loads (a version from before): read from now on."""
        if not self._old_directory:
            log.warning("the directory grants no pushed loads (a version from before them): loads are read")
        self._old_directory = True

    def push(self, prepared: specs.LoadPrepared, items: list[tuple[np.ndarray, specs.ReplicaLocation]]
             ) -> tuple[list[bool], list[int]]:
        """Items in DRAM of workers that granted pushes, one request per worker: (per item pushed,
        the indices of the others and of those whose push failed)."""
        done = [False] * len(items)
        grants = {g.worker: g for g in prepared.grants if self._wanted(g)}
        by_worker: dict[str, list[int]] = {}
        for k, (_, location) in enumerate(items):
            grant = grants.get(location.worker)
            if grant is not None and location.tier == "dram" and location.epoch == grant.epoch:
                by_worker.setdefault(location.worker, []).append(k)
        failed = 0
        for worker, ks in by_worker.items():
            ok = self._push(grants[worker], prepared, [items[k] for k in ks])
            for k in ks:
                done[k] = ok
            failed += 0 if ok else len(ks)
            PUSHES.labels("pushed" if ok else "failed").inc(len(ks))
        rest = [k for k in range(len(items)) if not done[k]]
        with self._lock:  # two groups of a load may be pushed at once
            self.pushed += len(items) - len(rest)
            self.read += len(rest)
            self.failed += failed
        return done, rest

    def wanted(self, prepared: specs.LoadPrepared) -> bool:
        """Whether any of the load's grants is one this engine pushes with."""
        return any(self._wanted(g) for g in prepared.grants)

    def memory_changed(self) -> None:
        with self._lock:
            self.generation += 1

    def forget(self) -> None:
        """Every worker this engine asked for a push refuses pushes into the memory it named from now
        on, and has none of them running, before this returns. A worker that cannot be told still
        ends each push at its deadline (the client's timeout, which has passed for every push this
        engine stopped waiting for) and then drops the engine's metadata."""
        self.memory_changed()
        with self._lock:
            told = dict(self._keys)
            self._sent.clear()
            self._keys.clear()
        for worker, (url, epoch, owner, key) in told.items():
            try:
                answer = self._client(url).call("POST", "/v1/push/forget", push.ForgetEngine(
                    tenant=self.tenant, owner=owner, reader=self.agent.name, epoch=epoch, engine_key=key,
                    generation=self.generation), push.ForgotEngine, FORGET_TIMEOUT_S)
            except KVStoreError as exc:
                log.warning("worker %s was not told that this engine's memory changed: %s", worker, exc)
                continue
            if not answer.quiet:
                log.warning("worker %s still ran a push into this engine's memory when it was told; it "
                            "dropped the engine's metadata", worker)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _wanted(self, grant: push.PushGrant) -> bool:
        if (grant.worker, grant.epoch) in self._no_push:
            return False
        if self.mode != "auto":
            return self.mode == "on"
        return not self.rdma and urlsplit(grant.control_url).hostname not in self.hosts

    def _push(self, grant: push.PushGrant, prepared: specs.LoadPrepared,
              items: list[tuple[np.ndarray, specs.ReplicaLocation]]) -> bool:
        hits = {hit.hash: hit for hit in prepared.blocks  # the directory signs a block that repeats once
                if hit.location.worker == grant.worker and hit.location.tier == "dram"}
        runs = [tuple(run) for hit in hits.values() for run in hit.location.runs]
        index = {run: i for i, run in enumerate(runs)}
        pairs = []
        for buffer, location in items:
            addr = int(buffer.ctypes.data)
            for run in location.runs:
                if tuple(run) not in index:  # not what the directory granted: read it
                    return False
                pairs.append((index[tuple(run)], addr))
                addr += run[1]
        with self._lock:
            self._keys[grant.worker] = (grant.control_url, grant.epoch, grant.owner, grant.engine_key)
            generation = self.generation
            fresh = self._sent.get(grant.worker) == generation
        for _ in range(2):
            try:
                answer = self._call(grant, prepared, runs, pairs, generation, fresh)
            except KVStoreError as exc:
                if exc.kind == "not_found":  # a worker from before pushed loads: not asked again this epoch
                    self._no_push.add((grant.worker, grant.epoch))
                log.warning("push of %d blocks by worker %s failed (%s): read instead", len(items), grant.worker, exc)
                return False
            except Exception as exc:  # noqa: BLE001 (metadata too large, NIXL refused it...): read all the same
                log.warning("push of %d blocks by worker %s not sent (%s: %s): read instead", len(items),
                            grant.worker, type(exc).__name__, exc)
                return False
            if answer.code == "ok":
                with self._lock:
                    self._sent[grant.worker] = max(generation, self._sent.get(grant.worker, 0))
                return True
            if answer.code != "metadata" or not fresh:
                log.warning("push of %d blocks by worker %s: %s (%s); read instead", len(items), grant.worker,
                            answer.code, answer.error)
                return False
            fresh = False  # the worker lost it (a restart): send it again
        return False

    def _call(self, grant: push.PushGrant, prepared: specs.LoadPrepared, runs: list, pairs: list, generation: int,
              fresh: bool) -> push.PushResult:
        metadata = None if fresh else base64.b64encode(self.agent.metadata()).decode()
        body = push.PushRequest(tenant=self.tenant, owner=grant.owner, reader=self.agent.name, epoch=grant.epoch,
                                token=prepared.token, expires_at=grant.expires_at, runs=runs, grant=grant.grant,
                                engine_key=grant.engine_key, items=pairs, wait_s=min(self.timeout_s, push.MAX_WAIT_S),
                                engine=push.EngineMemory(generation=generation, metadata=metadata))
        return self._client(grant.control_url).call("POST", "/v1/push", body, push.PushResult,
                                                     body.wait_s + HTTP_MARGIN_S)

    def _client(self, url: str) -> JsonHttp:
        with self._lock:
            if url not in self._clients:
                self._clients[url] = JsonHttp(url, timeout_s=self.timeout_s + HTTP_MARGIN_S, ca_file=self.ca_file)
            return self._clients[url]
