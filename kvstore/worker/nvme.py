"""The NVMe tier: slab files pre-allocated once, registered with NIXL once, split into pages.

    tier = NvmeTier(directory, total_bytes, page_bytes, direct="auto")   # open + posix_fallocate + replay
    tier.register(agent)                                  # FILE registrations (fd mode), once
    tier.io_bytes(nbytes) -> bytes a transfer moves       # nbytes, rounded up to DIRECT_ALIGN with O_DIRECT
    tier.rows(runs, nbytes) -> (offset, len, fd) rows     # descriptors of a block's pages
    tier.record(item) / tier.forget(token, runs)          # the manifest, written with the data
    tier.sync()                                           # ... and made durable before answering
    tier.survivors() -> what the manifest says is stored  # restart recovery

The manifest is an append-only JSON-lines log next to the slabs: a "put" line
after a block's bytes are written, a "free" line when its pages are given
back. Replaying it after a crash yields the blocks whose bytes were written;
the directory keeps those it still knows and the connector verifies every
byte by checksum anyway.

Slabs are opened with O_DIRECT where the filesystem takes it (`direct`): the
page cache would hold a second copy of what the DRAM tier just let go, and
push it out. O_DIRECT needs every buffer, offset and length aligned to the
device's blocks: pages are whole multiples of `DIRECT_ALIGN` (the worker
checks its page size), arenas are mmap'd, and a transfer moves a block's bytes
rounded up to `DIRECT_ALIGN`, within its last page on both sides.

Its first line records the page size the slabs were split with; pages are
numbered in it, so a directory keeps that page size whatever the setting says
later (a manifest without that line predates it: its page size is
`legacy_page_bytes`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path

import numpy as np

from kvstore.core import moving, specs
from kvstore.core.errors import KVStoreError
from kvstore.core.pages import PageAllocator

log = logging.getLogger(__name__)
SLAB_BYTES = 1 << 30
LEGACY_PAGE_BYTES = 64 << 10  # the page size of every tier before manifests recorded theirs
MANIFEST = "manifest.jsonl"
DIRECT_ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (a 4 KiB-sector drive's)
DIRECT_MODES = ("auto", "on", "off")  # O_DIRECT where the filesystem takes it / or refuse to start / never


class NvmeTier:
    def __init__(self, directory: Path, total_bytes: int, page_bytes: int, legacy_page_bytes: int | None = None,
                 direct: str = "off") -> None:
        self.directory = Path(directory)
        recorded, written_down = _recorded_page_bytes(self.directory / MANIFEST, legacy_page_bytes or page_bytes)
        if recorded is not None and recorded != page_bytes:
            log.warning("NVMe directory %s keeps the page size it was created with, %d bytes (the setting says %d)",
                        self.directory, recorded, page_bytes)
            page_bytes = recorded
        self.page_bytes = page_bytes
        slab_pages = max(1, SLAB_BYTES // page_bytes)
        num_pages = total_bytes // page_bytes
        if num_pages < 1:
            raise KVStoreError("invalid", "the NVMe tier must hold at least one page",
                               nvme_bytes=total_bytes, page_bytes=page_bytes)
        self.slab_pages = min(slab_pages, num_pages)
        self.direct = _direct_wanted(direct, page_bytes)
        self.allocator = PageAllocator(num_pages, page_bytes)
        self.fds = [self._open_slab(i, min(self.slab_pages, num_pages - i * self.slab_pages))
                    for i in range(-(-num_pages // self.slab_pages))]
        self._manifest = self._open_manifest()
        if os.fstat(self._manifest).st_size == 0:
            os.write(self._manifest, (json.dumps({"op": "meta", "page_bytes": page_bytes}) + "\n").encode())
            os.fsync(self._manifest)
        self._live = self._replay()
        if recorded is not None and not written_down:
            self._rewrite()  # a manifest from before page sizes were recorded: its size is written down now
        self._pending: dict[str, dict] = {}  # "put" lines waiting for their data to be durable
        self._frees: list[dict] = []  # "free" lines waiting for the next sync
        self._dirty: set[int] = set()  # slabs written since the last sync
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.num_pages * self.page_bytes

    def io_bytes(self, nbytes: int) -> int:
        """The bytes a transfer of an `nbytes` block moves: O_DIRECT moves whole aligned sectors."""
        return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN if self.direct else nbytes

    def _open_slab(self, index: int, pages: int) -> int:
        path = self.directory / f"slab-{index:04d}.bin"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = self._open_direct(path) if self.direct else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.posix_fallocate(fd, 0, pages * self.page_bytes)
        except OSError as exc:
            raise KVStoreError("unavailable", f"cannot prepare NVMe slab {path}: {exc.strerror}",
                               path=str(path)) from None
        return fd

    def _open_direct(self, path: Path) -> int:
        """The slab opened with O_DIRECT; with "auto", without it if the filesystem refuses (EINVAL:
        tmpfs before Linux 6.6, some network filesystems)."""
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            if self.direct == "on":
                raise KVStoreError("invalid", f"the filesystem of {self.directory} refuses O_DIRECT (nvme_direct "
                                   "is on): use another folder or nvme_direct auto", path=str(path)) from None
            log.warning("the filesystem of %s refuses O_DIRECT: NVMe slabs go through the page cache",
                        self.directory)
            self.direct = None
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def _open_manifest(self) -> int:
        try:
            return os.open(self.directory / MANIFEST, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise KVStoreError("unavailable", f"cannot open the NVMe manifest: {exc.strerror}",
                               path=str(self.directory / MANIFEST)) from None

    def register(self, agent) -> None:
        for i, fd in enumerate(self.fds):
            agent.register_file(fd, self.slab_pages * self.page_bytes, str(self.directory / f"slab-{i:04d}.bin"))

    def rows(self, runs: list[specs.PageRun], nbytes: int) -> np.ndarray:
        """(file offset, len, fd) rows covering `nbytes` of these pages; runs are split at slab ends."""
        out, left = [], nbytes
        for run in runs:
            page, end = run.first, run.first + run.count
            while page < end and left > 0:
                slab, offset = divmod(page, self.slab_pages)
                pages = min(end - page, self.slab_pages - offset)
                length = min(pages * self.page_bytes, left)
                out.append((offset * self.page_bytes, length, self.fds[slab]))
                left -= length
                page += pages
        assert left == 0, "pages do not cover the block"
        return np.array(out, dtype=np.uint64)

    # ---- manifest ----------------------------------------------------------------------

    def record(self, item: moving.MoveItem) -> None:
        """A block was written to these pages; its "put" line is written by the next `sync`, after
        the data is durable, so the manifest never names pages whose bytes a crash could lose."""
        entry = {"op": "put", "token": item.dst_token, "runs": [[r.first, r.count] for r in item.dst_runs],
                 "namespace_id": item.namespace_id, "hash": item.hash, "nbytes": item.nbytes,
                 "checksum": item.checksum}
        key = _key(item.dst_token, entry["runs"])
        slabs = {s for r in item.dst_runs
                 for s in range(r.first // self.slab_pages, (r.first + r.count - 1) // self.slab_pages + 1)}
        with self._lock:
            self._pending[key] = entry
            self._live[key] = entry
            self._dirty |= slabs

    def forget(self, token: str, runs: list[specs.PageRun] | None) -> None:
        """These pages were given back (None: every block under `token`): a "put" not yet written is
        dropped, a written one gets a "free" line (written by the next `sync`, before any "put" that
        reuses the pages)."""
        with self._lock:
            keys = [_key(token, [[r.first, r.count] for r in runs])] if runs is not None else \
                [key for key, entry in self._live.items() if entry["token"] == token]
            for key in keys:
                entry = self._live.pop(key, None)
                if entry is not None and self._pending.pop(key, None) is None:
                    self._frees.append({"op": "free", "token": token, "runs": entry["runs"]})

    def sync(self) -> None:
        """Make what was written durable: the data of the slabs written since the last sync first
        (`fdatasync`: the slabs are allocated whole, so no metadata a read needs changes), then the
        manifest lines naming it, frees before puts, in one append. Called once per move request
        before it is answered (so a block the directory commits is in the manifest) and once per
        free request. If the append fails (a full disk) the manifest is cut back to where it was,
        nothing is lost from memory, and `KVStoreError("unavailable")` says why: the caller fails
        the moves it made; the frees are written by the next sync that succeeds."""
        with self._lock:
            if not self._pending and not self._frees:
                return
            try:
                for slab in sorted(self._dirty) if self._pending else []:
                    os.fdatasync(self.fds[slab])
                    self._dirty.discard(slab)
            except OSError as exc:
                raise KVStoreError("unavailable", f"cannot make the NVMe slabs durable: {exc.strerror}",
                                   path=str(self.directory)) from None
            text = "".join(json.dumps(e) + "\n" for e in [*self._frees, *self._pending.values()]).encode()
            end = os.lseek(self._manifest, 0, os.SEEK_END)
            try:
                view = memoryview(text)
                while view:
                    view = view[os.write(self._manifest, view):]
                os.fdatasync(self._manifest)  # its new length is data a read needs: fdatasync writes it
            except OSError as exc:
                os.ftruncate(self._manifest, end)  # never a torn line that would swallow the next one
                raise KVStoreError("unavailable", f"cannot write the NVMe manifest: {exc.strerror}",
                                   path=str(self.directory / MANIFEST)) from None
            self._frees.clear()
            self._pending.clear()

    def sync_moves(self, items: list[moving.MoveItem]) -> str | None:
        """`sync` before a move request is answered: None once durable; otherwise (a full disk) why,
        with the "put" lines of this request's moves to NVMe dropped (they are reported failed)."""
        try:
            self.sync()
            return None
        except KVStoreError as exc:
            self.drop_pending([item for item in items if item.dst_kind == "nvme"])
            log.warning("%s: this request's moves to NVMe are reported failed", exc.message)
            return exc.message

    def drop_pending(self, items: list[moving.MoveItem]) -> None:
        """Forget the "put" lines of these moves, which a failed `sync` could not write (the moves
        are reported failed, and the directory gives their pages back)."""
        with self._lock:
            for item in items:
                key = _key(item.dst_token, [[r.first, r.count] for r in item.dst_runs])
                if self._pending.pop(key, None) is not None:
                    self._live.pop(key, None)

    def _replay(self) -> dict[str, dict]:
        live: dict[str, dict] = {}
        with open(self._manifest, closefd=False) as lines:
            text = lines.read()
        if text and not text.endswith("\n"):  # a line torn by a crash ends here, not in the next one
            os.write(self._manifest, b"\n")
        for number, line in enumerate(text.splitlines(), 1):
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict) or entry.get("op") == "meta":
                    continue
                key = _key(entry["token"], entry["runs"])
            except (ValueError, KeyError, TypeError):
                log.warning("NVMe manifest line %d is damaged; ignored", number)
                continue
            if entry.get("op") == "put":
                live[key] = entry
            elif entry.get("op") == "free":
                live.pop(key, None)
        for entry in live.values():  # the pages of surviving blocks stay taken
            runs = [specs.PageRun(first=f, count=c) for f, c in entry["runs"]]
            if not self.allocator.reserve(entry["token"], runs):
                log.warning("NVMe manifest entry %s overlaps another; ignored", entry["hash"])
        return live

    def _rewrite(self) -> None:
        """The manifest as its page size and the live blocks, written aside, fsynced and renamed over
        the old one (a crash leaves one or the other, whole)."""
        path, aside = self.directory / MANIFEST, self.directory / (MANIFEST + ".new")
        lines = [{"op": "meta", "page_bytes": self.page_bytes}, *self._live.values()]
        with open(aside, "w") as f:
            f.write("".join(json.dumps(e) + "\n" for e in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(aside, path)
        os.close(self._manifest)
        self._manifest = self._open_manifest()

    def survivors(self) -> list[specs.Survivor]:
        return [specs.Survivor(kind="nvme", token=e["token"], runs=[specs.PageRun(first=f, count=c)
                                                                     for f, c in e["runs"]],
                               namespace_id=e["namespace_id"], hash=e["hash"], nbytes=e["nbytes"],
                               checksum=e["checksum"]) for e in self._live.values()]

    def close(self) -> None:
        os.close(self._manifest)
        for fd in self.fds:
            os.close(fd)


def _direct_wanted(direct: str, page_bytes: int) -> str | None:
    """"on" or "auto" when slabs are to be opened with O_DIRECT, None when not."""
    if direct not in DIRECT_MODES:
        raise KVStoreError("invalid", f"nvme_direct must be one of {', '.join(DIRECT_MODES)}", nvme_direct=direct)
    if direct != "off" and page_bytes % DIRECT_ALIGN:
        if direct == "on":
            raise KVStoreError("invalid", f"O_DIRECT needs NVMe pages in multiples of {DIRECT_ALIGN} bytes",
                               page_bytes=page_bytes)
        log.warning("NVMe pages of %d bytes are not multiples of %d: slabs go through the page cache", page_bytes,
                    DIRECT_ALIGN)
        return None
    return None if direct == "off" else direct


def _recorded_page_bytes(path: Path, legacy_page_bytes: int) -> tuple[int | None, bool]:
    """The page size a manifest's pages are numbered in, and whether its first line says so:
    (that size, True); (`legacy_page_bytes`, False) for a manifest from before that line; (None,
    False) for no manifest (or an empty one)."""
    try:
        with open(path) as f:
            first = f.readline()
    except OSError:  # none yet, or no folder: opening the slabs says what is wrong
        return None, False
    if not first.strip():
        return None, False
    try:
        meta = json.loads(first)
        if meta.get("op") == "meta" and isinstance(meta.get("page_bytes"), int) and meta["page_bytes"] >= 4096:
            return meta["page_bytes"], True
    except (ValueError, AttributeError):
        pass
    return legacy_page_bytes, False


def _key(token: str, runs: list) -> str:
    return token + ":" + ",".join(f"{f}+{c}" for f, c in runs)
