"""Pushes into engines' memory: this worker's side of worker-pushed loads (`kvstore.core.push`).

    pushes = Pushes(agent, arena, identity=lambda: (name, epoch, secret))
    pushes.push(PushRequest) -> PushResult     # WRITE leased DRAM runs into the engine; answers when there
    pushes.forget(ForgetEngine) -> bool        # after no push into the engine's old memory runs

An engine is known by its reader name, which is its NIXL agent name: the metadata it sends must
name that agent, and it may not name one this worker already talks to for another reason (a peer
worker). It is also bound to the credential it called the directory with (`owner` in the grant):
an engine with another credential never has its blocks written into this one's memory and cannot
forget for it; it may replace this one's registration while idle, never while it pushes. A push
has its own time from its arrival: one that waited that long for a registration never starts,
and one still running then is given up and the engine's metadata dropped, which closes the
worker's connection to it (NIXL cancels no posted request more firmly than that).
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
from kvstore.transfer import JOIN_BYTES, Agent

log = logging.getLogger(__name__)
MAX_ENGINES = 256  # engines whose metadata is kept; the least recently used idle one beyond it is dropped
MAX_FLOORS = 256  # generations remembered per credential, of its engines dropped or forgotten
MAX_CREDENTIALS = 64  # credentials whose floors are remembered: the least recently used beyond it go
FORGET_WAIT_S = push.MAX_WAIT_S + 5.0  # a forget waits this long for the engine's running pushes
_MAGIC = b"nixlSerDes|Agent"


@dataclass
class _Engine:
    identity: tuple[str, str]  # (tenant, owner)
    generation: int
    peer: str | None
    active: int = 0
    loading: bool = False  # its metadata is being loaded, outside the lock


class Pushes:
    def __init__(self, agent: Agent, arena: HostBuffer, identity: Callable[[], tuple[str, int, str | None]],
                 max_engines: int = MAX_ENGINES) -> None:
        """`identity()`: this worker's (name, epoch, control secret) now."""
        self._agent, self._arena, self._identity, self._max = agent, arena, identity, max_engines
        self._engines: OrderedDict[str, _Engine] = OrderedDict()  # by reader, its NIXL agent name
        # (tenant, owner) -> reader -> the lowest generation still taken: one credential's forgets
        # never push another's out
        self._floors: OrderedDict[tuple[str, str], OrderedDict[str, int]] = OrderedDict()
        self._abandoned: list = []  # transfers given up while posted, released once NIXL lets go of them
        self._cond = threading.Condition()

    def push(self, req: push.PushRequest) -> push.PushResult:
        name, epoch, secret = self._authorize(req.tenant, req.owner, req.reader, req.epoch, req.engine_key)
        if not push.same(req.grant, push.lease_grant(secret, name, epoch, req.tenant, req.owner, req.reader,
                                                     req.token, req.expires_at, req.runs)):
            raise KVStoreError("forbidden", "the grant does not name these runs (ask the directory again)")
        deadline = time.monotonic() + min(req.wait_s, push.MAX_WAIT_S)  # the engine reads instead after it
        local, remote = self._rows(req)
        engine, peer, refusal = self._engine(req, deadline)
        if refusal is not None:
            return refusal
        transfer, state = None, "failed"
        try:
            left = min(deadline - time.monotonic(), req.expires_at - time.time())
            if left <= 0:  # waited too long for the engine's registration: the engine has moved on
                return push.PushResult(code="failed", error="the push's time or its lease ran out before it began")
            transfer = self._agent.submit("WRITE", local, remote, peer, join_up_to=JOIN_BYTES)
            state = transfer.wait(left)
        finally:
            with self._cond:
                engine.active -= 1
                if transfer is not None and transfer.abandoned:  # it may still be writing: cut the engine off
                    self._drop_peer(engine)
                    self._abandoned.append(transfer)
                self._abandoned = [t for t in self._abandoned if not t.settled()]
                self._cond.notify_all()
        return push.PushResult(code="ok") if state == "done" else push.PushResult(code="failed", error=transfer.error)

    def forget(self, req: push.ForgetEngine) -> bool:
        """Refuse pushes under generations below `req.generation` from now on; True once no push runs
        into the engine's memory (False: one still ran after FORGET_WAIT_S; its metadata is dropped)."""
        self._authorize(req.tenant, req.owner, req.reader, req.epoch, req.engine_key)
        with self._cond:
            self._raise_floor((req.tenant, req.owner, req.reader), req.generation)
            engine = self._engines.get(req.reader)
            if engine is None or engine.identity != (req.tenant, req.owner):
                return True
            quiet = self._cond.wait_for(lambda: engine.active == 0, FORGET_WAIT_S)
            self._drop_peer(engine)
            if self._engines.get(req.reader) is engine:
                del self._engines[req.reader]
            return quiet

    def close(self) -> None:
        with self._cond:
            for engine in self._engines.values():
                self._drop_peer(engine)
            self._engines.clear()

    def _authorize(self, tenant: str, owner: str, reader: str, epoch: int, key: str) -> tuple[str, int, str]:
        name, current, secret = self._identity()
        if secret is None:
            raise KVStoreError("forbidden", "this worker runs without a control secret: it pushes nothing")
        if not push.same(key, push.engine_key(secret, name, epoch, tenant, owner, reader)):
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
            if index >= len(req.runs):
                raise KVStoreError("invalid", "an item names no granted run", index=index)
            addr, nbytes = req.runs[index]
            if addr < lo or addr + nbytes > hi:
                raise KVStoreError("invalid", "a granted run is not in this worker's DRAM arena", addr=addr)
            if dest + nbytes > 1 << 64:
                raise KVStoreError("invalid", "an engine address range ends past 2**64", dest=dest)
            local.append((addr, nbytes))
            remote.append((dest, nbytes))
        return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)

    def _engine(self, req: push.PushRequest, deadline: float) -> tuple[_Engine | None, str | None,
                                                                       push.PushResult | None]:
        """The engine's registration, counted active, and its NIXL peer, (re)loaded from the request's
        metadata when it is newer; or the answer that refuses the push. Everything is read again
        after each wait, and no wait outlasts `deadline`."""
        identity, generation = (req.tenant, req.owner), req.engine.generation
        with self._cond:
            while True:
                left = max(0.0, deadline - time.monotonic())
                if generation < self._floors.get(identity, {}).get(req.reader, 0):
                    return None, None, push.PushResult(code="stale", error="the engine has released that memory")
                engine = self._engines.get(req.reader)
                if engine is not None and engine.identity != identity:
                    if engine.active:
                        raise KVStoreError("conflict", "another engine pushes under this reader name here")
                    self._forget_engine(req.reader, engine)  # its next push registers it again
                    engine = None
                if engine is not None and generation < engine.generation:
                    return None, None, push.PushResult(code="stale",
                                                       error="the engine has registered newer memory since")
                if engine is not None and engine.peer is not None and engine.generation == generation:
                    engine.active += 1
                    self._engines.move_to_end(req.reader)
                    return engine, engine.peer, None
                if engine is not None and engine.loading and engine.generation == generation:
                    # another push is loading it: how that ends says whether this one can go
                    if not self._cond.wait_for(lambda e=engine: not e.loading, left):
                        raise KVStoreError("unavailable", "the engine's metadata is still being loaded",
                                           retry_after_s=1)
                    continue
                if req.engine.metadata is None:
                    return None, None, push.PushResult(code="metadata", error="send the engine's NIXL metadata")
                if engine is not None and engine.active:  # pushes into the older memory end first
                    if not self._cond.wait_for(lambda e=engine: self._engines.get(req.reader) is not e or
                                               e.active == 0, left):
                        raise KVStoreError("unavailable", "the engine's earlier pushes are still running",
                                           retry_after_s=1)
                    continue
                blob = _metadata(req)
                if engine is not None:
                    self._drop_peer(engine)
                elif self._agent.has_peer(req.reader):
                    raise KVStoreError("forbidden", "that reader name is an agent this worker talks to already")
                fresh = _Engine(identity, generation, None, active=1, loading=True)  # holds the name meanwhile
                self._engines[req.reader] = fresh
                self._engines.move_to_end(req.reader)
                break
        return fresh, self._load(req.reader, fresh, blob), None

    def _load(self, reader: str, engine: _Engine, blob: bytes) -> str:
        """Load the engine's metadata into NIXL outside the lock (other engines push meanwhile); its
        registration, counted active, waits in the table with no peer until then."""
        try:
            peer = self._agent.add_peer(blob)  # KVStoreError "unavailable": NIXL cannot load it
            if peer != reader:  # the blob said one name and NIXL loaded another: never used
                self._agent.remove_peer(peer)
                raise KVStoreError("invalid", "the engine's metadata names another agent than its reader name")
        except BaseException:
            with self._cond:
                engine.active -= 1
                engine.loading = False
                if self._engines.get(reader) is engine:
                    del self._engines[reader]
                self._cond.notify_all()
            raise
        with self._cond:
            engine.peer, engine.loading = peer, False
            for name in list(self._engines)[: max(0, len(self._engines) - self._max)]:
                if self._engines[name].active == 0:
                    self._forget_engine(name, self._engines[name])
            self._cond.notify_all()
        return peer

    def _forget_engine(self, reader: str, engine: _Engine) -> None:
        """Drop an idle engine's registration; it registers again (same generation or newer) to be pushed to."""
        self._drop_peer(engine)
        del self._engines[reader]
        self._raise_floor((*engine.identity, reader), engine.generation)

    def _raise_floor(self, key: tuple[str, str, str], generation: int) -> None:
        identity, reader = key[:2], key[2]
        floors = self._floors.setdefault(identity, OrderedDict())
        self._floors.move_to_end(identity)
        floors[reader] = max(generation, floors.get(reader, 0))
        floors.move_to_end(reader)
        while len(floors) > MAX_FLOORS:
            floors.popitem(last=False)
        while len(self._floors) > MAX_CREDENTIALS:
            self._floors.popitem(last=False)

    def _drop_peer(self, engine: _Engine) -> None:
        if engine.peer is not None:
            peer, engine.peer = engine.peer, None
            try:
                self._agent.remove_peer(peer)
            except Exception as exc:  # noqa: BLE001 (NIXL refused: the metadata is unusable all the same)
                log.warning("dropping engine %s's metadata: %s", peer, exc)


def _metadata(req: push.PushRequest) -> bytes:
    """The request's NIXL metadata, if it is base64 and names the reader's agent."""
    try:
        blob = base64.b64decode(req.engine.metadata, validate=True)
    except (binascii.Error, ValueError):
        raise KVStoreError("invalid", "the engine's metadata is not base64") from None
    if agent_name(blob) != req.reader:
        raise KVStoreError("invalid", "the engine's metadata names another agent than its reader name")
    return blob


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
