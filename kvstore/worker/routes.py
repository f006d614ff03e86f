"""One block per route: what the mover does for each (source tier, destination tier) pair, and
NVMe -> S3 for many blocks at once through the bounce buffer.

    mover._move_one(item) -> None | error       # the route `_<src>_to_<dst>` of the item
    mover._nvme_to_s3_batch([(i, item)]) -> {i: None | error}

`Routes` is the mover's mixin: it uses the mover's tiers (`arena`, `nvme`, `s3`, `hbm`, `gds`,
`bounce`, `bounce_pages`, and `_parked`: bounce pages an abandoned NIXL request may still use), its
NIXL requests (`_post`, `_abandoned`) and its DRAM rows and checksums. Errors
are strings; two kinds say more than "failed" (`SourceCorrupt`, `Refused`).
"""

from __future__ import annotations

import numpy as np

from kvstore.core import moving
from kvstore.core.memory import HostBuffer
from kvstore.transfer import paired

ROUTES = {("dram", "nvme"), ("nvme", "dram"), ("dram", "s3"), ("s3", "dram"), ("nvme", "s3"),
          ("hbm", "dram"), ("dram", "hbm")}  # the hbm routes are GPU paths (UCX on VRAM)


class SourceCorrupt(str):
    """A move's error saying the source replica failed its checksum: that replica is bad."""


class Refused(str):
    """A move's error found before any byte moved: the request cannot be served here as it is."""


class Routes:
    def _can(self, route: tuple[str, str]) -> bool:
        present = {"dram": True, "nvme": self.nvme is not None, "s3": self.s3 is not None,
                   "hbm": self.hbm is not None}
        if route in (("hbm", "nvme"), ("nvme", "hbm")):
            return self.gds
        return route in ROUTES and present[route[0]] and present[route[1]]

    def _move_one(self, item: moving.MoveItem) -> str | None:
        route = (item.src_kind, item.dst_kind)
        if not self._can(route):
            return Refused(f"this worker cannot move {item.src_kind} -> {item.dst_kind}")
        return getattr(self, "_" + "_to_".join(route))(item)

    def _hbm_to_dram(self, item: moving.MoveItem) -> str | None:  # GPU path
        if self.hbm.checksum(item.src_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch in HBM before demotion")
        local, remote = paired(self.dram_rows(item.dst_runs, item.nbytes), self.hbm.rows(item.src_runs, item.nbytes))
        error = self._post("READ", local, remote, "VRAM")
        if error:
            return error
        return None if self.dram_checksum(item.dst_runs, item.nbytes) == item.checksum else \
            "checksum mismatch after copying from HBM"

    def _dram_to_hbm(self, item: moving.MoveItem) -> str | None:  # GPU path
        if self.dram_checksum(item.src_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch in DRAM before promotion")
        local, remote = paired(self.dram_rows(item.src_runs, item.nbytes), self.hbm.rows(item.dst_runs, item.nbytes))
        error = self._post("WRITE", local, remote, "VRAM")
        if error:
            return error
        return None if self.hbm.checksum(item.dst_runs, item.nbytes) == item.checksum else \
            "checksum mismatch after copying to HBM"

    def _hbm_to_nvme(self, item: moving.MoveItem) -> str | None:  # GPU path (GDS)
        if self.hbm.checksum(item.src_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch in HBM before demotion")
        nbytes = self.nvme.io_bytes(item.nbytes)
        local, remote = paired(self.hbm.rows(item.src_runs, nbytes), self.nvme.rows(item.dst_runs, nbytes))
        error = self._post("WRITE", local, remote, "FILE", local_mem="VRAM")
        if error is None:
            self.nvme.record(item)
        return error

    def _nvme_to_hbm(self, item: moving.MoveItem) -> str | None:  # GPU path (GDS)
        nbytes = self.nvme.io_bytes(item.nbytes)
        local, remote = paired(self.hbm.rows(item.dst_runs, nbytes), self.nvme.rows(item.src_runs, nbytes))
        error = self._post("READ", local, remote, "FILE", local_mem="VRAM")
        if error is None and self.hbm.checksum(item.dst_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch after reading from NVMe")
        return error

    def _dram_to_nvme(self, item: moving.MoveItem) -> str | None:
        if self.dram_checksum(item.src_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch in DRAM before demotion")
        error = self._file("WRITE", item.src_runs, item.dst_runs, item.nbytes)
        if error is None:
            self.nvme.record(item)
        return error

    def _nvme_to_dram(self, item: moving.MoveItem) -> str | None:
        error = self._file("READ", item.dst_runs, item.src_runs, item.nbytes)
        if error is None and self.dram_checksum(item.dst_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch after reading from NVMe")
        return error

    def _dram_to_s3(self, item: moving.MoveItem) -> str | None:
        if self.dram_checksum(item.src_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch in DRAM before demotion")
        if len(item.src_runs) == 1:
            return self._object("WRITE", self.dram_rows(item.src_runs, item.nbytes), item)

        def gathered(runs):  # OBJ writes whole objects from one region: gather scattered pages first
            rows = self.dram_rows(runs, item.nbytes, self.bounce)
            at = int(rows[0][0]) - self.bounce.addr
            for addr, length in self.dram_rows(item.src_runs, item.nbytes):
                self.bounce.array[at : at + int(length)] = self.arena.view(int(addr) - self.arena.addr, int(length))
                at += int(length)
            return self._object("WRITE", rows, item)
        return self._through_bounce(item, gathered)

    def _s3_to_dram(self, item: moving.MoveItem) -> str | None:
        error = self._object("READ", self.dram_rows(item.dst_runs, item.nbytes), item)
        if error is None and self.dram_checksum(item.dst_runs, item.nbytes) != item.checksum:
            return SourceCorrupt("checksum mismatch after reading from S3")
        return error

    def _nvme_to_s3(self, item: moving.MoveItem) -> str | None:
        def copy(runs):
            error = self._file("READ", runs, item.src_runs, item.nbytes, self.bounce)
            if error is None and self.dram_checksum(runs, item.nbytes, self.bounce) != item.checksum:
                return SourceCorrupt("checksum mismatch after reading from NVMe")
            return error or self._object("WRITE", self.dram_rows(runs, item.nbytes, self.bounce), item)
        return self._through_bounce(item, copy)

    def _through_bounce(self, item: moving.MoveItem, copy) -> str | None:
        token = f"bounce-{item.dst_token}-{item.hash}"
        runs, posted = self._bounce(token, item.nbytes), len(self._abandoned())
        if runs is None:
            return f"the {self.bounce.nbytes}-byte bounce buffer cannot hold a {item.nbytes}-byte block now"
        try:
            return copy(runs)
        finally:
            self._unbounce([(token, runs)], posted)

    def _bounce(self, token: str, nbytes: int):
        """Contiguous bounce pages for one block, or None; first, pages parked behind NIXL requests
        that have since settled go back."""
        with self._parked_lock:
            settled = [p for p in self._parked if all(t.settled() for t in p[0])]
            self._parked = [p for p in self._parked if not any(p is q for q in settled)]
        for _, pages in settled:
            for held, runs in pages:
                self.bounce_pages.free(held, runs)
        return self.bounce_pages.allocate(token, nbytes, contiguous=True)

    def _unbounce(self, pages: list, posted: int) -> None:
        """Give bounce pages back, unless a NIXL request of this move since `posted` (its count of
        abandoned requests before) timed out while posted: those pages wait until it settles."""
        stuck = self._abandoned()[posted:]
        if stuck:
            with self._parked_lock:
                self._parked.append((stuck, pages))
            return
        for token, runs in pages:
            self.bounce_pages.free(token, runs)

    def _file(self, op: str, dram_runs, nvme_runs, nbytes: int, buffer: HostBuffer | None = None) -> str | None:
        return self._post(op, *self._file_rows(dram_runs, nvme_runs, nbytes, buffer), "FILE")

    def _file_rows(self, dram_runs, nvme_runs, nbytes: int, buffer: HostBuffer | None = None):
        """Paired descriptors of one block between DRAM pages (of the arena or `buffer`) and NVMe
        pages, in whole sectors with O_DIRECT (within both last pages)."""
        nbytes = self.nvme.io_bytes(nbytes)
        return paired(self.dram_rows(dram_runs, nbytes, buffer), self.nvme.rows(nvme_runs, nbytes))

    def _object(self, op: str, local: np.ndarray, item: moving.MoveItem) -> str | None:
        if op == "WRITE":
            self.s3.claim(f"{item.namespace_id}/{item.hash}", item.dst_token)
        remote = self.s3.rows(self.agent, f"{item.namespace_id}/{item.hash}", item.nbytes, local)
        return self._post(op, local, remote, "OBJ")

    def _nvme_to_s3_batch(self, items: list[tuple[int, moving.MoveItem]]) -> dict[int, str | None]:
        """NVMe -> S3 for many blocks: one POSIX read of all the bounce buffer holds now, a checksum
        each, one OBJ write of those that match. What does not fit, or was in a request that
        failed, goes block by block after (unless the move's deadline passed meanwhile). A batch
        takes at most half of the bounce buffer, so other moves through it can run beside it."""
        errors: dict[int, str | None] = {}
        held, pages, posted = [], 0, len(self._abandoned())  # held: (index, item, bounce token, bounce runs)
        try:
            for i, item in items:
                token = f"bounce-{item.dst_token}-{item.hash}"
                fits = not held or pages + self.bounce_pages.pages_for(item.nbytes) <= self.bounce_pages.num_pages // 2
                runs = self._bounce(token, item.nbytes) if fits else None
                if runs is None:
                    break
                held.append((i, item, token, runs))
                pages += sum(r.count for r in runs)
            read = [self._file_rows(runs, item.src_runs, item.nbytes, self.bounce) for _, item, _, runs in held]
            if held and self._post("READ", np.concatenate([r[0] for r in read]),
                                   np.concatenate([r[1] for r in read]), "FILE") is None:
                good = []
                for i, item, _, runs in held:
                    if self.dram_checksum(runs, item.nbytes, self.bounce) != item.checksum:
                        errors[i] = SourceCorrupt("checksum mismatch after reading from NVMe")
                    else:
                        good.append((i, item, self.dram_rows(runs, item.nbytes, self.bounce)))
                for _, item, _ in good:
                    self.s3.claim(f"{item.namespace_id}/{item.hash}", item.dst_token)
                remote = [self.s3.rows(self.agent, f"{item.namespace_id}/{item.hash}", item.nbytes, rows)
                          for _, item, rows in good]
                if good and self._post("WRITE", np.concatenate([rows for _, _, rows in good]),
                                       np.concatenate(remote), "OBJ") is None:
                    errors.update((i, None) for i, _, _ in good)
        finally:
            self._unbounce([(token, runs) for _, _, token, runs in held], posted)
        expired = len(self._abandoned()) > posted and "the move's deadline passed during the copy"
        errors.update((i, expired or self._move_one(item)) for i, item in items if i not in errors)
        return errors
