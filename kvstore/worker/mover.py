"""Executes the directory's moves between this worker's tiers with NIXL.

    mover.move(MoveRequest) -> MoveResult     # failures are values, per block

Every route checks the block checksum on the way: the source is hashed as it
leaves DRAM (beside the write to NVMe, before any other), and what arrives in
DRAM is hashed before it counts. A mismatch fails the item, so corrupt bytes
never become a replica.

    dram -> nvme   POSIX WRITE into slab pages; the manifest records the block
    nvme -> dram   POSIX READ (promotion)
    dram -> s3     OBJ WRITE (one PUT; scattered pages are first gathered into
                   contiguous DRAM pages, since OBJ writes whole objects at offset 0)
    s3 -> dram     OBJ READ (ranged GETs; promotion)
    nvme -> s3     through the bounce buffer (registered once): one POSIX READ into it, one OBJ WRITE
    hbm <-> dram   UCX on VRAM, loopback (GPU path)
    hbm <-> nvme   GDS_MT (cuFile), VRAM <-> slab file, when the worker has it (checked at start)
    dram -> a peer's dram   UCX WRITE into another worker's arena (the request names the peer: its
                   agent metadata and arena); the directory has the peer check what arrived

All blocks of one route in a request travel in one NIXL request (two for NVMe -> S3). What
each route does for one block is `routes.py`.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvstore.core import moving, specs
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent, paired
from kvstore.core.pages import PageAllocator
from kvstore.worker.fencing import MoveFence
from kvstore.worker.hbm import HbmArena
from kvstore.worker.metrics import WorkerMetrics
from kvstore.worker.nvme import NvmeTier
from kvstore.worker.routes import Refused, Routes, SourceCorrupt
from kvstore.worker.s3 import S3Tier

log = logging.getLogger(__name__)
MAX_WAIT_S = 300.0  # one NIXL request between two tiers, at most (or until the move's deadline)
_request = threading.local()  # the move request this thread serves: its deadline and tokens
BATCHED = {("dram", "nvme"), ("nvme", "dram"), ("dram", "s3"), ("s3", "dram")}
READ_GROUPS = 4  # requests a batch read into DRAM is split into, so checksums run beside the reads


class Mover(Routes):
    def __init__(self, agent: Agent, arena: HostBuffer, page_bytes: int, nvme: NvmeTier | None,
                 s3: S3Tier | None, bounce_bytes: int, hbm: HbmArena | None = None, gds: bool = False,
                 metrics: WorkerMetrics | None = None, fence: MoveFence | None = None) -> None:
        self.agent = agent
        self.fence = fence or MoveFence()  # told of NIXL requests that may still write after their move answered
        self.metrics = metrics or WorkerMetrics()
        self.arena = arena
        self.page_bytes = page_bytes
        # copies that must pass through DRAM use their own buffer, registered once: the DRAM
        # tier is usually full exactly when blocks need to move down
        self.bounce = HostBuffer(bounce_bytes) if s3 else None
        self.bounce_pages = PageAllocator(bounce_bytes // page_bytes, page_bytes) if self.bounce else None
        if self.bounce:
            agent.register_dram(self.bounce.addr, self.bounce.nbytes)
        self._parked: list[tuple[list, list]] = []  # (abandoned transfers, bounce pages they may still use)
        self._parked_lock = threading.Lock()
        self.nvme, self.s3, self.hbm, self.gds = nvme, s3, hbm, gds
        self._hashing = ThreadPoolExecutor(2, thread_name_prefix="move-checksum")  # beside a write to NVMe
        self._peers: dict[str, str] = {}  # agent name -> the name NIXL loaded it under
        self._peers_lock = threading.Lock()

    def move(self, req: moving.MoveRequest) -> moving.MoveResult:
        if req.expires_at is not None and time.time() >= req.expires_at:
            n = len(req.items)
            self._count(req.items, ["expired"] * n, [False] * n)
            return moving.MoveResult(ok=[False] * n, errors=["the move's deadline passed before it started"] * n,
                                    codes=["expired"] * n)
        _request.at, _request.tokens, _request.abandoned = req.expires_at, {i.dst_token for i in req.items}, []
        return self._to_peer(req) if req.peer is not None else self._move(req)

    def _to_peer(self, req: moving.MoveRequest) -> moving.MoveResult:
        """Every item from this worker's DRAM into the peer's, in one UCX request; each source is
        checked against its checksum first."""
        started = time.perf_counter()
        errors: dict[int, str | None] = {}
        todo = []
        for i, item in enumerate(req.items):
            if (item.src_kind, item.dst_kind) != ("dram", "dram"):
                errors[i] = Refused(f"a copy to another worker goes DRAM to DRAM, not {item.src_kind} -> "
                                    f"{item.dst_kind}")
            elif self.dram_checksum(item.src_runs, item.nbytes) != item.checksum:
                errors[i] = SourceCorrupt("checksum mismatch in DRAM before the copy to another worker")
            else:
                todo.append(i)
        if todo:
            peer = req.peer
            try:
                name = self._peer(peer)
                pairs = [paired(self.dram_rows(req.items[i].src_runs, req.items[i].nbytes),
                                 np.array(specs.page_spans(peer.base_addr, peer.page_bytes, req.items[i].dst_runs,
                                                           req.items[i].nbytes), dtype=np.uint64)) for i in todo]
                error = self._post("WRITE", np.concatenate([p[0] for p in pairs]),
                                   np.concatenate([p[1] for p in pairs]), "DRAM", peer=name)
            except Exception as exc:  # noqa: BLE001 (bad metadata or a peer NIXL cannot load: the items fail)
                error = f"cannot write to worker agent {peer.agent_name}: {exc}"
            errors.update((i, error) for i in todo)
            if error:
                log.warning("copy of %d blocks to worker agent %s failed: %s", len(todo), peer.agent_name, error)
        self.metrics.move_seconds.labels("dram_peer_dram").observe(time.perf_counter() - started)
        ordered = [errors[i] for i in range(len(req.items))]
        codes = ["ok" if e is None else "source_corrupt" if isinstance(e, SourceCorrupt) else "failed"
                 for e in ordered]
        self._count(req.items, codes, [isinstance(e, Refused) for e in ordered])
        return moving.MoveResult(ok=[e is None for e in ordered], errors=ordered, codes=codes)

    def _peer(self, peer: moving.Peer) -> str:
        """The peer's agent, loaded once per agent name (a restarted worker has a new one)."""
        with self._peers_lock:
            if peer.agent_name not in self._peers:
                self._peers[peer.agent_name] = self.agent.add_peer(base64.b64decode(peer.agent_metadata))
            return self._peers[peer.agent_name]

    def _move(self, req: moving.MoveRequest) -> moving.MoveResult:
        errors: dict[int, str | None] = {}
        for i, item in enumerate(req.items):
            if item.dst_kind == "nvme" and self.nvme and not self.nvme.allocator.owns(item.dst_token, item.dst_runs):
                errors[i] = Refused("the destination pages are not held by this move's token (rolled back?)")
        by_route: dict[tuple[str, str], list[int]] = {}
        s3_down = self.s3.unreachable() if self.s3 and any("s3" in (i.src_kind, i.dst_kind) for i in req.items) \
            else None
        for i, item in enumerate(req.items):
            if i in errors:
                continue
            if s3_down and "s3" in (item.src_kind, item.dst_kind):
                errors[i] = s3_down  # fail fast: the directory backs off and retries later
                continue
            by_route.setdefault((item.src_kind, item.dst_kind), []).append(i)
        for route, indices in by_route.items():
            started = time.perf_counter()
            if route in BATCHED and self._can(route) and len(indices) > 1:
                errors.update(self._batch(route, [(i, req.items[i]) for i in indices]))
            elif route == ("nvme", "s3") and self._can(route) and len(indices) > 1:
                errors.update(self._nvme_to_s3_batch([(i, req.items[i]) for i in indices]))
            else:
                errors.update((i, self._move_one(req.items[i])) for i in indices)
            self.metrics.move_seconds.labels("_".join(route)).observe(time.perf_counter() - started)
        if s3_down:
            refused = sum(e == s3_down for e in errors.values())
            log.warning("%d moves to or from S3 refused: %s", refused, s3_down)
            self.metrics.s3_errors.labels("unreachable").inc(refused)
        for i, error in errors.items():
            if error and error != s3_down:
                item = req.items[i]
                log.warning("move of block %s %s->%s failed: %s", item.hash, item.src_kind, item.dst_kind, error)
        failed = self.nvme.sync_moves(req.items) if self.nvme is not None else None  # a full disk: the reason
        for i, item in enumerate(req.items):
            if failed and item.dst_kind == "nvme" and errors.get(i) is None:
                errors[i] = failed
        ordered = [errors[i] for i in range(len(req.items))]
        codes = ["ok" if e is None else "source_corrupt" if isinstance(e, SourceCorrupt) else "failed"
                 for e in ordered]
        self._count(req.items, codes, [e is not None and (e is s3_down or isinstance(e, Refused)) for e in ordered])
        return moving.MoveResult(ok=[e is None for e in ordered], errors=ordered, codes=codes)

    def _count(self, items: list[moving.MoveItem], codes: list[str], refused: list[bool]) -> None:
        """Moves by route and result; checksum failures; failures of S3 itself (not refusals: an
        unreachable S3 was counted already, a request this worker cannot serve is not S3's)."""
        m = self.metrics
        for item, code, was_refused in zip(items, codes, refused):
            route = f"{item.src_kind}_{item.dst_kind}"
            m.moves.labels(route, code).inc()
            if code == "ok":
                m.moved_bytes.labels(route).inc(item.nbytes)
            elif code == "source_corrupt":
                m.checksum_failures.labels(item.src_kind).inc()
            elif code == "failed" and "s3" in (item.src_kind, item.dst_kind) and not was_refused:
                m.s3_errors.labels("failed").inc()

    def _batch(self, route: tuple[str, str], items: list[tuple[int, moving.MoveItem]]) -> dict[int, str | None]:
        """All items of one route in one NIXL request (reads into DRAM: `_read_checked`); checksums per
        block; a failed request falls back to a request per block. To NVMe, sources are hashed on
        another thread as they are written (a bad one lands in pages the directory gives back, and is
        never recorded)."""
        checking = self._hashing.submit(self._source_errors, items) if route == ("dram", "nvme") else None
        errors = self._source_errors(items) if route[0] == "dram" and checking is None else {}
        todo = [(i, item) for i, item in items if i not in errors and
                (route != ("dram", "s3") or len(item.src_runs) == 1)]
        rows = [self._route_rows(route, item) for _, item in todo]
        if route[1] == "dram":  # every item, at least two
            return self._read_checked(todo, rows, f"after reading from {'NVMe' if route[0] == 'nvme' else 'S3'}")
        if todo:
            local, remote = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
            if route[1] == "s3":  # just before the write: a late delete of an earlier copy skips it
                for _, item in todo:
                    self.s3.claim(f"{item.namespace_id}/{item.hash}", item.dst_token)
            posted = len(self._abandoned())
            failed = self._post("WRITE" if route[0] == "dram" else "READ", local, remote, rows[0][2])
            errors.update(checking.result() if checking is not None else {})
            if failed:
                return {**errors, **{i: self._retry(item, posted) for i, item in items if i not in errors}}
        for i, item in todo:
            if i not in errors:
                errors[i] = None
                if route[1] == "nvme":
                    self.nvme.record(item)
        for i, item in items:  # what could not join the batch (scattered pages to S3)
            if i not in errors:
                errors[i] = self._move_one(item)
        return errors

    def _read_checked(self, todo: list[tuple[int, moving.MoveItem]], rows: list,
                      where: str) -> dict[int, str | None]:
        """Blocks read into DRAM in up to READ_GROUPS requests posted at once; a group's blocks are
        hashed on the checksum threads as soon as its request is done, beside the later groups' reads.
        A group whose request failed is retried block by block, unless the move's deadline passed."""
        total, at, groups = sum(item.nbytes for _, item in todo), 0, {}
        for k, (_, item) in enumerate(todo):  # consecutive blocks, about total / READ_GROUPS bytes a group
            groups.setdefault(at * READ_GROUPS // total, []).append(k)
            at += item.nbytes
        groups = list(groups.values())
        posted, before = [], len(self._abandoned())
        try:
            for g in groups:
                posted.append(self.agent.submit("READ", np.concatenate([rows[k][0] for k in g]),
                                                np.concatenate([rows[k][1] for k in g]), self.agent.name, "DRAM",
                                                rows[0][2]))
        except Exception:
            for transfer in posted:  # nothing of this move may still write once it has answered
                self._wait(transfer, rows[0][2])
            raise
        errors, hashing = {}, []
        for g, transfer in zip(groups, posted):
            members = [todo[k] for k in g]
            if self._wait(transfer, rows[0][2]) is None:
                hashing.append(self._hashing.submit(lambda m=members: {i: None if self.dram_checksum(
                    item.dst_runs, item.nbytes) == item.checksum else SourceCorrupt(f"checksum mismatch {where}")
                    for i, item in m}))
            else:
                errors.update((i, self._retry(item, before)) for i, item in members)
        for done in hashing:
            errors.update(done.result())
        return errors

    def _source_errors(self, items: list[tuple[int, moving.MoveItem]]) -> dict[int, str]:
        return {i: SourceCorrupt("checksum mismatch in DRAM before demotion") for i, item in items
                if self.dram_checksum(item.src_runs, item.nbytes) != item.checksum}

    def _route_rows(self, route: tuple[str, str], item: moving.MoveItem):
        dram_runs = item.src_runs if route[0] == "dram" else item.dst_runs
        other_runs = item.dst_runs if route[0] == "dram" else item.src_runs
        if "nvme" in route:
            return (*self._file_rows(dram_runs, other_runs, item.nbytes), "FILE")
        dram = self.dram_rows(dram_runs, item.nbytes)
        return dram, self.s3.rows(self.agent, f"{item.namespace_id}/{item.hash}", item.nbytes, dram), "OBJ"

    def _post(self, op: str, local: np.ndarray, remote: np.ndarray, remote_mem: str,
              local_mem: str = "DRAM", peer: str | None = None) -> str | None:
        """One NIXL request between local memory and one of this worker's own tiers (or a peer's
        memory); None when done."""
        return self._wait(self.agent.submit(op, local, remote, peer or self.agent.name, local_mem, remote_mem),
                          remote_mem)

    def _wait(self, transfer, remote_mem: str) -> str | None:
        """None once a posted request is done, else why not (one that may still write is fenced)."""
        deadline = getattr(_request, "at", None)
        wait_s = MAX_WAIT_S if deadline is None else max(0.0, min(MAX_WAIT_S, deadline - time.time()))
        if transfer.wait(wait_s) == "done":
            return None
        if transfer.abandoned:  # posted and not finished: it may write after the move has answered
            self.fence.stuck(getattr(_request, "tokens", set()), transfer)
            self._abandoned().append(transfer)
        self.metrics.nixl_failures.labels(remote_mem).inc()
        return transfer.error

    def _retry(self, item: moving.MoveItem, posted: int) -> str | None:
        """A block of a failed request, once more on its own; not when a request of this move since
        `posted` (its count of abandoned requests then) timed out: the deadline has passed."""
        if len(self._abandoned()) > posted:
            return "the move's deadline passed during the copy"
        return self._move_one(item)

    def _abandoned(self) -> list:
        """The NIXL requests of the move this thread serves that timed out while posted (NIXL may
        still run them: the memory they use is not reused before they settle)."""
        return _request.__dict__.setdefault("abandoned", [])

    def dram_rows(self, runs: list[specs.PageRun], nbytes: int, buffer: HostBuffer | None = None) -> np.ndarray:
        buffer = buffer or self.arena
        return np.array(specs.page_spans(buffer.addr, self.page_bytes, runs, nbytes), dtype=np.uint64)

    def verify(self, req: moving.VerifyRequest) -> moving.VerifyResult:
        """Whether each replica's pages still hash to its checksum (a reader reported a mismatch)."""
        matches: list[bool | None] = []
        for item in req.items:
            if item.kind == "dram":
                matches.append(self.dram_checksum(item.runs, item.nbytes) == item.checksum)
            elif item.kind == "hbm" and self.hbm is not None:  # GPU path
                matches.append(self.hbm.checksum(item.runs, item.nbytes) == item.checksum)
            else:
                matches.append(None)
            if matches[-1] is False:
                self.metrics.checksum_failures.labels(item.kind).inc()
        return moving.VerifyResult(matches=matches)

    def dram_checksum(self, runs: list[specs.PageRun], nbytes: int, buffer: HostBuffer | None = None) -> str:
        buffer = buffer or self.arena
        hasher = xxhash.xxh3_64()
        for addr, length in self.dram_rows(runs, nbytes, buffer):
            hasher.update(buffer.view(int(addr) - buffer.addr, int(length)))
        return hasher.hexdigest()

