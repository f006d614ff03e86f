"""A storage worker process: arena, NIXL agent, control endpoint, registration, heartbeats.

    worker = StorageWorker(settings); worker.start()   # allocate + register arena once, register
    worker.run(stop_event)                              # heartbeat until stopped
    worker.close()
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import threading
import time
import uuid

from kvstore.client import DirectoryClient
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.core.sizes import format_size
from kvstore.transfer import Agent
from kvstore.core.pages import PageAllocator
from kvstore.worker.control import ControlServer
from kvstore.worker.metrics import WorkerMetrics
from kvstore.worker.hbm import HbmArena
from kvstore.worker.fencing import MoveFence
from kvstore.worker.mover import Mover
from kvstore.worker.pushes import Pushes
from kvstore.worker.nvme import DIRECT_ALIGN, LEGACY_PAGE_BYTES, NvmeTier
from kvstore.worker.sharing import ArenaShare
from kvstore.worker.s3 import S3Tier
from kvstore.worker.settings import WorkerSettings

log = logging.getLogger(__name__)
REJOIN_WAIT_S = 330.0  # the longest a directory lets a move run, and then some


class StorageWorker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        num_pages = settings.dram_bytes // settings.page_bytes
        if num_pages < 1:
            raise KVStoreError("invalid", "the DRAM tier must hold at least one page",
                               dram_bytes=settings.dram_bytes, page_bytes=settings.page_bytes)
        self.hbm = HbmArena(settings.hbm_bytes, settings.page_bytes, settings.hbm_device) \
            if settings.hbm_bytes else None
        # a manifest from before pages sizes were recorded was written with the page size set, or the old default
        legacy = settings.page_bytes if "page_bytes" in settings.model_fields_set else LEGACY_PAGE_BYTES
        direct = settings.nvme_direct if settings.page_bytes % DIRECT_ALIGN == 0 else "off"  # DRAM's pages too
        self.nvme = NvmeTier(settings.nvme_dir, settings.nvme_bytes, settings.page_bytes, legacy, direct) \
            if settings.nvme_bytes else None
        self.s3 = S3Tier(settings.s3_endpoint, settings.s3_bucket, settings.s3_prefix, settings.s3_region,
                         settings.s3_virtual_addressing) if settings.s3_bucket else None
        # no page faults on saves; a memfd when engines of this host may map it
        self.arena = HostBuffer(num_pages * settings.page_bytes, populate=True, shared=settings.arena_dir is not None)
        self.allocator = PageAllocator(num_pages, settings.page_bytes)
        backends = {"UCX": {}}
        if self.nvme:
            backends["POSIX"] = {"use_uring": "true"} if settings.posix_queue == "uring" else {"use_aio": "true"}
        if self.s3:
            backends["OBJ"] = self.s3.backend_params()
        self.agent = Agent(f"{settings.name}-{uuid.uuid4().hex[:8]}", backends=backends)
        self.gds = bool(self.hbm and self.nvme and settings.gds != "off" and self.agent.add_backend("GDS_MT", {}))
        if self.hbm and self.nvme and settings.gds == "on" and not self.gds:
            raise KVStoreError("unavailable", "--gds on: the GDS_MT backend cannot be loaded here (it needs "
                               "CUDA and cuFile); start with --gds auto or off")
        self.agent.register_dram(self.arena.addr, self.arena.nbytes)
        allocators = {"dram": self.allocator}
        if self.hbm:
            self.hbm.register(self.agent)
            allocators["hbm"] = self.hbm.allocator
        if self.nvme:
            self.nvme.register(self.agent)
            allocators["nvme"] = self.nvme.allocator
        probe = self.hbm.gds_probe(self.agent, tuple(self.nvme.rows([specs.PageRun(first=0, count=1)],
                                                                     settings.page_bytes)[0])) if self.gds else "done"
        if probe == "pending":  # it may still write into HBM page 0: never start with it in flight
            raise KVStoreError("unavailable", "a GDS read of one page into HBM did not finish in 10 s; "
                               "start with --gds off")
        if probe != "done":
            if settings.gds == "on":
                raise KVStoreError("unavailable", f"--gds on: GDS cannot read the NVMe tier's files under "
                                   f"{settings.nvme_dir} (cuFile refused them); start with --gds auto or off")
            log.warning("GDS cannot read the NVMe tier's files under %s (cuFile refused them): HBM <-> NVMe "
                        "moves go through DRAM", settings.nvme_dir)
            self.gds = False
            self.agent.backends.remove("GDS_MT")  # the directory routes HBM <-> NVMe by it
        self.metrics = WorkerMetrics()
        fence = MoveFence()
        self.mover = Mover(self.agent, self.arena, settings.page_bytes, self.nvme, self.s3, settings.bounce_bytes,
                           self.hbm, gds=self.gds, metrics=self.metrics, fence=fence)
        self.secret = secrets.token_urlsafe(32)  # the directory's calls must carry it; new at every start
        tls = (str(settings.tls_cert), str(settings.tls_key)) if settings.tls_cert and settings.tls_key else None
        self.control = ControlServer(allocators, settings.host, settings.port, mover=self.mover.move,
                                     on_free=self._freed, after_free=self._frees_done,
                                     object_tiers={"s3": self.s3.delete} if self.s3 else {},
                                     verifier=self.mover.verify, secret=self.secret, tls=tls, metrics=self.metrics,
                                     open_metrics=settings.open_metrics, metrics_token=settings.metrics_token,
                                     advertise=settings.advertise_host, fence=fence,
                                     pushes=Pushes(self.agent, self.arena,
                                                   lambda: (self.settings.name, self.epoch, self.secret)))
        self.directory = DirectoryClient(settings.directory_url, timeout_s=10.0, token=settings.token,
                                         ca_file=settings.ca_file)
        self.epoch = 0
        self.heartbeat_interval_s = 1.0
        self.share = ArenaShare(settings.arena_dir / f"{settings.name}.sock", self.arena,
                                lambda: {"agent_name": self.agent.name, "epoch": self.epoch},
                                lambda reason: self.metrics.share_errors.labels(reason).inc()) \
            if settings.arena_dir is not None else None

    def _freed(self, kind: str, token: str, runs: list[specs.PageRun] | None) -> None:
        """Pages given back (`runs` None: every page the token held): their "free" line is queued
        as they go back, and written by `_frees_done`."""
        if kind == "nvme" and self.nvme:
            self.nvme.forget(token, runs)

    def _frees_done(self) -> None:
        """A free request's "free" lines written in one manifest sync (a line per block and a sync
        each made a free of 256 NVMe blocks 256 syncs). A lost line could resurrect pages that were
        reused: whatever a sync writes, it writes the queued frees before any put."""
        if self.nvme:
            try:
                self.nvme.sync()
            except KVStoreError as exc:  # written before any line that reuses the pages, by a later sync
                log.warning("%s; the frees are written later", exc.message)

    def tier_specs(self) -> list[specs.TierSpec]:
        tiers = [specs.TierSpec(kind="dram", capacity_bytes=self.arena.nbytes,
                                page_bytes=self.settings.page_bytes, base_addr=self.arena.addr)]
        if self.hbm:
            tiers.append(specs.TierSpec(kind="hbm", capacity_bytes=self.hbm.nbytes,
                                        page_bytes=self.settings.page_bytes, base_addr=self.hbm.addr,
                                        device=self.hbm.device))
        if self.nvme:
            tiers.append(specs.TierSpec(kind="nvme", capacity_bytes=self.nvme.capacity_bytes,
                                        page_bytes=self.nvme.page_bytes))
        if self.s3:
            tiers.append(specs.TierSpec(kind="s3", capacity_bytes=None, page_bytes=1))
        return tiers

    def inventory(self) -> list[specs.Survivor]:
        return (self.nvme.survivors() if self.nvme else []) + (self.s3.survivors() if self.s3 else [])

    def start(self, wait_for_directory_s: float = 30.0) -> None:
        self.control.start()
        if self.share is not None:
            try:
                self.share.start()
            except OSError as exc:  # engines load over NIXL instead
                log.warning("cannot share the DRAM arena at %s: %s", self.share.path, exc)
                self.share = None
        deadline = time.monotonic() + wait_for_directory_s
        while True:
            try:
                self.register()
                break
            except KVStoreError as exc:
                if exc.kind != "unavailable" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        log.info("worker %s up: directory %s, control %s, NIXL agent %s, backends %s, "
                 "DRAM arena %s registered (%d pages of %s)", self.settings.name, self.settings.directory_url,
                 self.control.url, self.agent.name, ",".join(self.agent.backends),
                 format_size(self.arena.nbytes), self.allocator.num_pages, format_size(self.settings.page_bytes))
        if self.nvme:
            log.info("NVMe tier: %s in %d slab file(s) under %s (%s), %d blocks survived",
                     format_size(self.nvme.capacity_bytes), len(self.nvme.fds), self.settings.nvme_dir,
                     "O_DIRECT" if self.nvme.direct else "page cache", len(self.nvme.survivors()))
        if self.s3:
            log.info("S3 tier: bucket %s, prefix %s, endpoint %s", self.s3.bucket, self.s3.prefix,
                     self.s3.endpoint or "AWS")

    def register(self) -> None:
        """Join (again) under a new epoch. The directory forgets our old DRAM and HBM replicas, so do we."""
        self.control.new_epoch()
        answer = self.directory.register_worker(specs.WorkerRegistration(
            name=self.settings.name, agent_name=self.agent.name,
            agent_metadata=base64.b64encode(self.agent.metadata()).decode(),
            control_url=self.control.url, pid=os.getpid(), backends=self.agent.backends, tiers=self.tier_specs(),
            inventory=self.inventory(), control_secret=self.secret))
        self.epoch, self.heartbeat_interval_s = answer.epoch, answer.heartbeat_interval_s
        log.info("registered with the directory as %s, epoch %d", self.settings.name, self.epoch)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_interval_s):
            self._beat()

    def _beat(self) -> None:
        try:
            self.directory.heartbeat(self.settings.name, self.epoch)
        except KVStoreError as exc:
            if exc.kind == "conflict":
                log.warning("directory does not know epoch %d any more; registering again", self.epoch)
                self._rejoin()
            else:
                log.warning("heartbeat failed: %s", exc)

    def _rejoin(self) -> None:
        """Joining again resets the DRAM arena's pages for the new epoch: first every move of the old
        one must have ended. A NIXL request that never finished may still write into the arena, so a
        worker with one does not join again: it exits, for its supervisor to start a fresh process."""
        if not self.mover.fence.quiesce(REJOIN_WAIT_S):
            log.critical("moves of epoch %d are still writing (a NIXL request that never finished); exiting "
                         "instead of reusing the DRAM arena under a new epoch: restart this worker", self.epoch)
            os._exit(3)
        self._try_register()

    def _try_register(self) -> None:
        try:
            self.register()
        except KVStoreError as exc:
            log.warning("registration failed: %s", exc)
            time.sleep(self.heartbeat_interval_s)

    def close(self) -> None:
        try:
            self.directory.deregister(self.settings.name, self.epoch)
        except KVStoreError as exc:
            log.warning("could not deregister: %s", exc)
        if self.share is not None:
            self.share.stop()
        self.control.stop()
        self.control.pushes.close()
        self.directory.close()
        self.agent.close()
        if self.nvme:
            self.nvme.close()

