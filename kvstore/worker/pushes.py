"""Pushes into engines' memory: this worker's side of worker-pushed loads (`kvstore.core.push`).

    pushes = Pushes(agent, arena, identity=lambda: (name, epoch, secret))
    pushes.push(PushRequest) -> PushResult     # WRITE leased DRAM runs into the engine; answers when there
    pushes.forget(ForgetEngine) -> bool        # after no push into the engine's old memory runs

An engine is known by its reader name, which is its NIXL agent name: the metadata it sends must
name that agent, and it may not name one this worker already talks to for another reason (a peer
worker) or that another tenant registered. A push that does not finish in its time is given up
and the engine's metadata dropped (its connection closed), so the request cannot land later.
"""

from __future__ import annotations

import base64
import binascii
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.core import push
from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent

log = logging.getLogger(__name__)
MAX_ENGINES = 256  # engines whose metadata is kept; the least recently used beyond it is dropped
MAX_PUSHES = 8  # pushes at once (each holds a connection of the control endpoint); more are refused
MAX_FLOORS = 4096  # generations remembered of engines dropped or forgotten
REGISTER_WAIT_S = 30.0  # a new registration waits this long for the engine's running pushes
_MAGIC = b"nixlSerDes|Agent"


@dataclass
class _Engine:
    tenant: str
    generation: int
    peer: str | None
    active: int = 0


class Pushes:
    def __init__(self, agent: Agent, arena: HostBuffer, identity: Callable[[], tuple[str, int, str | None]],
                 max_engines: int = MAX_ENGINES) -> None:
        """`identity()`: this worker's (name, epoch, control secret) now."""
        self._agent, self._arena, self._identity, self._max = agent, arena, identity, max_engines
        self._engines: OrderedDict[str, _Engine] = OrderedDict()
        self._floors: OrderedDict[str, int] = OrderedDict()  # reader -> lowest generation still accepted
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(MAX_PUSHES)

    def push(self, req: push.PushRequest) -> push.PushResult:
        if not self._slots.acquire(blocking=False):
            raise KVStoreError("unavailable", f"this worker runs {MAX_PUSHES} pushes already: read the blocks",
                               retry_after_s=1)
        try:
            return self._push(req)
        finally:
            self._slots.release()

    def _push(self, req: push.PushRequest) -> push.PushResult:
        name, epoch, secret = self._authorize(req.tenant, req.reader, req.epoch, req.engine_key)
        if not push.same(req.grant, push.lease_grant(secret, name, epoch, req.tenant, req.reader, req.token,
                                                     req.expires_at, req.runs)):
            raise KVStoreError("forbidden", "the grant does not cover these runs (ask the directory again)")
        if time.time() >= req.expires_at:
            return push.PushResult(code="failed", error="the grant expired with the lease it was given for")
        local, remote = self._rows(req)
        engine, refusal = self._engine(req)
        if refusal is not None:
            return refusal
        state, error = "failed", None
        try:
            transfer = self._agent.submit("WRITE", local, remote, engine.peer)
            state = transfer.wait(max(0.001, min(req.wait_s, req.expires_at - time.time())))
            error = transfer.error
        finally:
            with self._cond:
                engine.active -= 1
                if state != "done" and engine.peer is not None:  # it may still be writing: cut it off
                    self._drop_peer(engine)
                self._cond.notify_all()
        return push.PushResult(code="ok") if state == "done" else push.PushResult(code="failed", error=error)

    def forget(self, req: push.ForgetEngine) -> bool:
        """Refuse pushes under generations below `req.generation` from now on; True once no push runs
        into the engine's memory (False: one still ran after REGISTER_WAIT_S; its metadata is gone)."""
        self._authorize(req.tenant, req.reader, req.epoch, req.engine_key)
        with self._cond:
            self._raise_floor(req.reader, req.generation)
            engine = self._engines.get(req.reader)
            if engine is None or engine.tenant != req.tenant:
                return True
            quiet = self._cond.wait_for(lambda: engine.active == 0, REGISTER_WAIT_S)
            self._drop_peer(engine)
            del self._engines[req.reader]
            return quiet

    def close(self) -> None:
        with self._cond:
            for engine in self._engines.values():
                self._drop_peer(engine)
            self._engines.clear()

    def _authorize(self, tenant: str, reader: str, epoch: int, key: str) -> tuple[str, int, str]:
        name, current, secret = self._identity()
        if secret is None:
            raise KVStoreError("forbidden", "this worker runs without a control secret: it pushes nothing")
        if not push.same(key, push.engine_key(secret, name, epoch, tenant, reader)):
            raise KVStoreError("forbidden", "the engine key was not issued for this engine and worker")
        if epoch != current:
            raise KVStoreError("conflict", f"the grant is for epoch {epoch}; this worker is at {current}",
                               epoch=current)
        return name, epoch, secret

    def _rows(self, req: push.PushRequest) -> tuple[np.ndarray, np.ndarray]:
        """(arena rows, engine rows) of the items; a run outside the granted list or the arena is refused."""
        lo, hi = self._arena.addr, self._arena.addr + self._arena.nbytes
        local, remote = [], []
        for index, dest in req.items:
            if not 0 <= index < len(req.runs):
                raise KVStoreError("invalid", "an item names no granted run", index=index)
            addr, nbytes = req.runs[index]
            if nbytes <= 0 or addr < lo or addr + nbytes > hi:
                raise KVStoreError("invalid", "a granted run is not in this worker's DRAM arena", addr=addr)
            if dest <= 0:
                raise KVStoreError("invalid", "an engine address must be positive", dest=dest)
            local.append((addr, nbytes))
            remote.append((dest, nbytes))
        return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)

    def _engine(self, req: push.PushRequest) -> tuple[_Engine | None, push.PushResult | None]:
        """The engine's registration, (re)loaded from the request's metadata when it is newer, counted
        active; or the answer that refuses the push."""
        with self._cond:
            engine = self._engines.get(req.reader)
            if req.engine.generation < self._floors.get(req.reader, 0) or \
                    (engine is not None and engine.tenant == req.tenant and req.engine.generation < engine.generation):
                return None, push.PushResult(code="stale", error="the engine has registered newer memory since")
            if engine is not None and engine.tenant != req.tenant:
                if engine.active:
                    raise KVStoreError("conflict", "another tenant's engine uses this reader name here")
                self._drop_peer(engine)
                del self._engines[req.reader]
                engine = None
            if engine is None or engine.peer is None or engine.generation < req.engine.generation:
                if req.engine.metadata is None:
                    return None, push.PushResult(code="metadata", error="send the engine's NIXL metadata")
                engine = self._register(req, engine)
            engine.active += 1
            self._engines.move_to_end(req.reader)
            return engine, None

    def _register(self, req: push.PushRequest, engine: _Engine | None) -> _Engine:
        """Load the engine's metadata (under the lock, once its running pushes ended)."""
        try:
            blob = base64.b64decode(req.engine.metadata, validate=True)
        except (binascii.Error, ValueError):
            raise KVStoreError("invalid", "the engine's metadata is not base64") from None
        if agent_name(blob) != req.reader:
            raise KVStoreError("invalid", "the engine's metadata names another agent than its reader name")
        if engine is not None:
            if not self._cond.wait_for(lambda: engine.active == 0, REGISTER_WAIT_S):
                raise KVStoreError("unavailable", "the engine's earlier pushes are still running", retry_after_s=1)
            self._drop_peer(engine)
        elif self._agent.has_peer(req.reader):
            raise KVStoreError("forbidden", "that reader name is an agent this worker talks to already")
        peer = self._agent.add_peer(blob)  # KVStoreError "unavailable": UCX cannot reach it
        engine = _Engine(req.tenant, req.engine.generation, peer)
        self._engines[req.reader] = engine
        self._floors.pop(req.reader, None)
        self._evict()
        return engine

    def _evict(self) -> None:
        for reader in list(self._engines)[: max(0, len(self._engines) - self._max)]:
            engine = self._engines[reader]
            if engine.active == 0:
                self._drop_peer(engine)
                del self._engines[reader]
                self._raise_floor(reader, engine.generation)

    def _raise_floor(self, reader: str, generation: int) -> None:
        self._floors[reader] = max(generation, self._floors.get(reader, 0))
        self._floors.move_to_end(reader)
        while len(self._floors) > MAX_FLOORS:
            self._floors.popitem(last=False)

    def _drop_peer(self, engine: _Engine) -> None:
        if engine.peer is not None:
            try:
                self._agent.remove_peer(engine.peer)
            except Exception as exc:  # noqa: BLE001 (NIXL refused: the metadata is unusable all the same)
                log.warning("dropping engine %s's metadata: %s", engine.peer, exc)
            engine.peer = None


def agent_name(blob: bytes) -> str | None:
    """The agent a NIXL metadata blob names (it starts "nixlSerDes|Agent", a length, the name), or None."""
    if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + 8:
        return None
    (length,) = struct.unpack_from("<Q", blob, len(_MAGIC))
    start = len(_MAGIC) + 8
    if length > 1024 or start + length > len(blob):
        return None
    try:
        return blob[start:start + length].decode()
    except UnicodeDecodeError:
        return None
