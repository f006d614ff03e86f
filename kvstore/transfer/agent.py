"""One NIXL agent per process, wrapped for kvstore.

Calls, in the order they happen:
    agent = Agent(name, backends={"UCX": {}})    # backends created explicitly
    reg = agent.register_dram(addr, nbytes)       # once per arena / staging buffer
    blob = agent.metadata()                       # published through the directory
    peer = agent.add_peer(blob_of_peer)           # when meeting a new (name, epoch)
    t = agent.submit("WRITE", local_rows, remote_rows, peer)   # never blocks
    t = agent.submit(..., join_up_to=JOIN_BYTES)  # rows that follow each other posted joined (`joined`)
    # or, for mappings that recur: prepare both sides once, then pick rows by int32 index
    lp, rp = agent.prepare(rows), agent.prepare(peer_rows, peer)
    t = agent.submit_prepared("READ", lp, idx, rp, idx, notification=b"...")
    t.poll() / t.wait(timeout)                    # "done" | "pending" | "failed"
    agent.notifications()                         # on the peer: {sender: [message, ...]}
    agent.remove_peer(peer); agent.close()
    local, remote = paired(local_rows, remote_rows)  # rows.py: both lists cut at the union of their boundaries

Pitfalls handled here: the Python binding makes the
UCX progress thread busy-poll a core, so we give it a 1 ms delay; agents are
shared by threads, so sync mode is STRICT; on hosts without RDMA the IB module
is left out, which avoids a segfault at interpreter exit; the cu12 wheel is
imported explicitly because `import nixl` picks cu13 on CPU-only hosts, and the cu13 wheel where
cu12 is not installed or KVSTORE_NIXL_MODULE=nixl_cu13 says so (a CUDA 13 host).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvstore.core.errors import KVStoreError
from kvstore.transfer.rows import joined

if not os.path.isdir("/sys/class/infiniband"):
    os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _import_nixl():
    """NIXL's Python modules (after the env above): KVSTORE_NIXL_MODULE's, else nixl_cu12's, else nixl_cu13's."""
    chosen = os.environ.get("KVSTORE_NIXL_MODULE")
    errors = []
    for name in [chosen] if chosen else ["nixl_cu12", "nixl_cu13"]:
        try:
            return importlib.import_module(f"{name}._api"), importlib.import_module(f"{name}._bindings")
        except ImportError as exc:
            if chosen:
                raise
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL cannot be imported (pip install nixl-cu12, or nixl-cu13 on a CUDA 13 host): "
                      + "; ".join(errors))


nixl_api, nixl_bindings = _import_nixl()

log = logging.getLogger(__name__)
_SETTLING = threading.Lock()  # an abandoned request is checked and released by one caller at a time

PROGRESS_DELAY_US = 1000
_make_native_agent = nixl_api.nixlBind.nixlAgent


def _native_agent_with_delay(name, cfg):
    cfg.pthrDelay = PROGRESS_DELAY_US
    return _make_native_agent(name, cfg)


nixl_api.nixlBind.nixlAgent = _native_agent_with_delay


@dataclass(frozen=True)
class Registration:
    addr: int
    nbytes: int
    mem_type: str
    handle: object


@dataclass(frozen=True)
class PreparedList:
    """A descriptor list prepared once (`Agent.prepare`); `peer` is None for the local side."""

    handle: object
    lengths: np.ndarray
    peer: str | None


class Transfer:
    """One posted request. Exceptions from NIXL are contained and become 'failed'."""

    def __init__(self, agent: "Agent", handle, nbytes: int) -> None:
        self._agent = agent
        self._handle = handle
        self.nbytes = nbytes
        self.state = "pending"
        self.error: str | None = None
        self.abandoned = False  # timed out while posted: NIXL may still be moving its bytes
        self.posted_at = time.perf_counter()
        self.done_at: float | None = None
        self.created = True  # NIXL took the request (its post may still fail)
        self._advance(agent._raw.transfer)

    @classmethod
    def failed(cls, nbytes: int, exc: Exception) -> "Transfer":
        """A request NIXL refused to create."""
        transfer = cls.__new__(cls)
        transfer.nbytes, transfer.state, transfer.abandoned, transfer.created = nbytes, "failed", False, False
        transfer.error = f"{type(exc).__name__}: {exc}"
        transfer.posted_at = transfer.done_at = time.perf_counter()
        return transfer

    def _advance(self, call) -> None:
        try:
            status = call(self._handle)
        except Exception as exc:  # nixl*Error: contained, reported as a failed result
            self._finish("failed", f"{type(exc).__name__}: {exc}")
            return
        if status == "DONE":
            self._finish("done", None)
        elif status not in ("PROC",):
            self._finish("failed", f"NIXL returned {status}")

    def _finish(self, state: str, error: str | None) -> None:
        self.state, self.error = state, error
        self.done_at = time.perf_counter()
        try:
            self._agent._raw.release_xfer_handle(self._handle)
        except Exception as exc:
            log.warning("releasing a transfer handle failed: %s", exc)

    def poll(self) -> str:
        if self.state == "pending":
            self._advance(self._agent._raw.check_xfer_state)
        return self.state

    def settled(self) -> bool:
        """Whether NIXL is done with this request: always, unless it was abandoned while posted; an
        abandoned one is asked again, and released once NIXL says it is no longer in progress (by
        one caller: the fence and the mover's bounce buffer may ask at once)."""
        with _SETTLING:
            if not self.abandoned:
                return True
            try:
                status = self._agent._raw.check_xfer_state(self._handle)
            except Exception:  # noqa: BLE001 (NIXL refuses the handle: nothing runs under it any more)
                status = "ERR"
            if status == "PROC":
                return False
            self.abandoned = False
        try:
            self._agent._raw.release_xfer_handle(self._handle)
        except Exception as exc:  # noqa: BLE001
            log.warning("releasing an abandoned transfer handle failed: %s", exc)
        return True

    def wait(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        spins = 0
        while self.poll() == "pending":
            if time.monotonic() > deadline:
                # A posted request cannot be aborted safely; report it and
                # leave the handle to the agent's teardown.
                self.state, self.error, self.abandoned = "failed", f"timed out after {timeout_s}s", True
                break
            spins += 1
            if spins > 100:
                time.sleep(0.0002)
        return self.state


class Agent:
    def __init__(self, name: str, backends: dict[str, dict[str, str]], progress_thread: bool = True):
        cfg = nixl_api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=[],
            sync_mode=nixl_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self._raw = nixl_api.nixl_agent(name, cfg)
        for backend, params in backends.items():
            try:
                self._raw.create_backend(backend, dict(params))
            except nixl_bindings.nixlNotFoundError:
                raise KVStoreError(
                    "unavailable", f"NIXL backend {backend} cannot be loaded on this host",
                    backend=backend, plugins=self.plugins(),
                ) from None
        self.backends = list(backends)
        self._regs: list[Registration] = []
        self._peers: set[str] = set()
        self._unjoinable: set[str] = set()  # peers that refused a joined list: their registrations touch

    def plugins(self) -> list[str]:
        """The backend plugins NIXL finds on this host (whether they load is another matter)."""
        return sorted(self._raw.get_plugin_list())

    def add_backend(self, backend: str, params: dict[str, str]) -> bool:
        """Create one more backend if this host can load it (e.g. GDS needs CUDA and cuFile); False if
        not. Memory registered afterwards is registered with it too."""
        try:
            self._raw.create_backend(backend, dict(params))
        except (nixl_bindings.nixlNotFoundError, nixl_bindings.nixlBackendError):
            return False
        self.backends.append(backend)
        return True

    def register_dram(self, addr: int, nbytes: int) -> Registration:
        handle = self._raw.register_memory([(addr, nbytes, 0, "")], "DRAM")
        reg = Registration(addr, nbytes, "DRAM", handle)
        self._regs.append(reg)
        return reg

    def register_vram(self, addr: int, nbytes: int, device: int) -> Registration:
        """GPU memory (a CUDA device pointer) for UCX and GDS. GPU path: needs CUDA-enabled UCX."""
        handle = self._raw.register_memory([(addr, nbytes, device, "")], "VRAM")
        reg = Registration(addr, nbytes, "VRAM", handle)
        self._regs.append(reg)
        return reg

    def register_file(self, fd: int, nbytes: int, path: str) -> Registration:
        """A file (fd mode) for the POSIX/GDS backends: rows then address it as (offset, len, fd)."""
        handle = self._raw.register_memory([(0, nbytes, fd, path)], "FILE")
        reg = Registration(0, nbytes, "FILE", handle)
        self._regs.append(reg)
        return reg

    def register_object(self, dev_id: int, nbytes: int, key: str) -> Registration:
        """An S3 object for the OBJ backend: rows then address it as (offset, len, dev_id)."""
        handle = self._raw.register_memory([(0, nbytes, dev_id, key)], "OBJ")
        reg = Registration(0, nbytes, "OBJ", handle)
        self._regs.append(reg)
        return reg

    def deregister(self, reg: Registration) -> None:
        self._raw.deregister_memory(reg.handle)
        self._regs.remove(reg)

    def metadata(self) -> bytes:
        return self._raw.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """The peer's agent name, its metadata loaded; KVStoreError("unavailable") when NIXL cannot
        load it (a worker gone: UCX cannot reach the address it names)."""
        try:
            name = self._raw.add_remote_agent(metadata)
        except Exception as exc:  # nixl*Error, contained as every NIXL failure here
            raise KVStoreError("unavailable", f"cannot load a peer's NIXL metadata: {type(exc).__name__}: {exc}") \
                from None
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        return name

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._raw.remove_remote_agent(name)  # refused: still loaded, and still said to be
            self._peers.discard(name)
            self._unjoinable.discard(name)

    def submit(self, op: str, local_rows: np.ndarray, remote_rows: np.ndarray, peer: str,
               mem_type: str = "DRAM", remote_mem_type: str = "DRAM", join_up_to: int = 0) -> Transfer:
        """Post `op` ("READ"/"WRITE") of local (addr, len) rows <-> remote (addr, len) rows. With
        `join_up_to`, rows that follow each other on both sides are posted joined, in pieces of about
        that many bytes (`joined`: NIXL posts each row of a request as a message of its own). A
        joined row may span two registrations that happen to touch: this side's are checked here;
        the peer's are NIXL's to check, which refuses such a request when it is created, before
        anything moves. The rows are then posted as given, and to that peer from then on (until its
        metadata is loaded again)."""
        assert op in ("READ", "WRITE"), f"bad op {op}"
        assert len(local_rows) == len(remote_rows), "descriptor lists differ in length"
        assert np.array_equal(local_rows[:, 1], remote_rows[:, 1]), "descriptor lengths differ"
        if join_up_to and peer not in self._unjoinable:
            local_joined, remote_joined = joined(local_rows, remote_rows, join_up_to)
            if len(local_joined) < len(local_rows) and self._registered(local_joined, mem_type):
                transfer = self.submit(op, local_joined, remote_joined, peer, mem_type, remote_mem_type)
                if transfer.created:
                    return transfer
                self._unjoinable.add(peer)
                log.info("NIXL refused %d rows joined into %d (%s): rows to %s are posted as given", len(local_rows),
                         len(local_joined), transfer.error, peer)
        try:
            handle = self._raw.initialize_xfer(
                op,
                self._raw.get_xfer_descs(_with_dev(local_rows), mem_type),
                self._raw.get_xfer_descs(_with_dev(remote_rows), remote_mem_type),
                peer,
            )
        except Exception as exc:  # unregistered range, unknown peer: a failed result, not a crash
            return Transfer.failed(int(local_rows[:, 1].sum()), exc)
        return Transfer(self, handle, int(local_rows[:, 1].sum()))

    def _registered(self, rows: np.ndarray, mem_type: str) -> bool:
        """Whether each (addr, len) row lies inside one of this agent's registrations of `mem_type`
        (rows that name a device or file are left to NIXL): a joined row across two registrations
        that touch is known here without asking NIXL, which refuses it with an error in its log."""
        if rows.shape[1] != 2:
            return True
        starts, ends = rows[:, 0], rows[:, 0] + rows[:, 1]
        inside = np.zeros(len(rows), dtype=bool)
        for reg in tuple(self._regs):  # other threads may register meanwhile
            if reg.mem_type == mem_type:
                inside |= (starts >= reg.addr) & (ends <= reg.addr + reg.nbytes)
        return bool(inside.all())

    def prepare(self, rows: np.ndarray, peer: str | None = None, mem_type: str = "DRAM") -> "PreparedList":
        """Prepare (addr, len) rows once; later transfers pick rows by index. `peer=None`: local side."""
        handle = self._raw.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", _with_dev(rows), mem_type)
        return PreparedList(handle, rows[:, 1].astype(np.uint64), peer)

    def submit_prepared(self, op: str, local: "PreparedList", local_idx: np.ndarray, remote: "PreparedList",
                        remote_idx: np.ndarray, notification: bytes | None = None) -> Transfer:
        """Post `op` of local rows `local_idx` <-> remote rows `remote_idx` (int32 indices; NIXL merges
        contiguous descriptors). The notification reaches the peer after the whole request completes."""
        assert op in ("READ", "WRITE"), f"bad op {op}"
        assert remote.peer is not None and local.peer is None, "prepare the local side with peer=None"
        local_idx = np.ascontiguousarray(local_idx, dtype=np.int32)
        remote_idx = np.ascontiguousarray(remote_idx, dtype=np.int32)
        nbytes = int(local.lengths[local_idx].sum())
        try:
            handle = self._raw.make_prepped_xfer(op, local.handle, local_idx, remote.handle, remote_idx,
                                                 notification or b"")
        except Exception as exc:
            return Transfer.failed(nbytes, exc)
        return Transfer(self, handle, nbytes)

    def release(self, prepared: "PreparedList") -> None:
        self._raw.release_dlist_handle(prepared.handle)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name (consumed)."""
        return self._raw.get_new_notifs()

    def notify(self, peer: str, message: bytes) -> bool:
        try:
            self._raw.send_notif(peer, message)
            return True
        except Exception as exc:
            log.warning("notification to %s failed: %s", peer, exc)
            return False

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        for reg in list(self._regs):
            try:
                self.deregister(reg)
            except Exception as exc:  # noqa: BLE001 - a backend that never took it (cuFile refused a file)
                log.warning("deregistering %s memory at close: %s", reg.mem_type, exc)
                self._regs.remove(reg)


def _with_dev(rows: np.ndarray) -> np.ndarray:
    """(addr, len) rows get devId 0; (addr, len, dev) rows (files: offset, len, fd) pass as they are."""
    if rows.shape[1] == 3:
        return np.ascontiguousarray(rows, dtype=np.uint64)
    out = np.zeros((rows.shape[0], 3), dtype=np.uint64)
    out[:, :2] = rows
    return out
