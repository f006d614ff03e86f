"""The engine-side store client.

Calls, in the order an engine makes them:
    client = KVStoreClient(url, namespace)      # registers namespace, NIXL agent, staging buffer once
    client.lookup(token_ids) -> hit tokens      # pure read
    client.load(token_ids) -> (kv, n)           # prepare_load -> NIXL READ -> verify -> complete_load
    client.save(token_ids, kv) -> tokens held   # prepare_store -> NIXL WRITE -> complete_store
    client.close()

Prefill/decode hand-off: the prefill engine calls `save(token_ids, kv, handoff=ID)`, which commits
hand-off ID once the save has; the decode engine calls `load(token_ids, wait_for=ID, timeout=S)`,
which waits for that commit (it may start before the prefill engine has) and then loads what is
there: after S seconds without one, that is a miss or a shorter prefix, never an exception.

`save_blocks` / `load_blocks` are the same protocol for engines that keep KV in the store's block
layout in memory they registered with `register_buffer` (zero copy); `save` / `load` pack and
unpack straight into and out of a mapped arena, through the staging buffer for NIXL.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.client import DirectoryClient
from kvstore.connector import calls, layout
from kvstore.connector.calls import PhaseClock, accepted, groups, request_hints
from kvstore.connector.arenas import LocalArenas
from kvstore.connector.copies import BlockCopier, Transform, reindexed, scatter
from kvstore.connector.handoff import HandoffResult, wait_for_handoff
from kvstore.connector.layerwise import LayerwiseLoad
from kvstore.connector.layout import LayerKV
from kvstore.connector.peers import Peers, own_hosts
from kvstore.connector.pushes import Pusher
from kvstore.connector.renewal import Renewal
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import HandoffCommit
from kvstore.core.keys import LAYOUTS, RAW_LAYOUTS, Namespace, block_hashes, checksum
from kvstore.core.memory import HostBuffer
from kvstore.transfer import Agent

log = logging.getLogger(__name__)
DEFAULT_STAGING_BYTES = 128 << 20
READ_GROUP_BYTES = 32 << 20  # loads are read and verified in groups of this size, overlapped
FETCHES_IN_FLIGHT = 2  # groups of a pushed load requested at once (reads go one at a time: faster here)


class KVStoreClient:
    def __init__(self, url: str | Sequence[str], namespace: Namespace, *, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 name: str | None = None, timeout_s: float = 60.0, renew_leases: bool = True,
                 token: str | None = None, ca_file: str | None = None, hosts: list[str] | None = None,
                 same_host: str | None = None, load_push: str | None = None) -> None:
        """`url`: the directory, or its replicas (comma-separated, or a list): calls move to the next
        on a connection error or a 5xx. `token`: an engine token of the namespace's tenant (default: $KVSTORE_TOKEN); `ca_file`:
        the CA bundle of an https directory (default: $KVSTORE_CA_FILE); `hosts`: addresses of this
        host a worker may have registered, beyond its names and addresses (saves prefer such workers).
        `same_host`: "auto" copies blocks straight into and out of the DRAM arena of a worker on this
        host that shares it, "off" always uses NIXL (default: $KVSTORE_SAME_HOST, else auto).
        `load_push`: which loads workers on other hosts WRITE into this engine's memory instead of it
        reading them, "auto" | "on" | "off" (default: $KVSTORE_LOAD_PUSH, else auto; see
        `kvstore.connector.pushes`)."""
        if namespace.layout not in (LAYOUTS[0], *RAW_LAYOUTS):  # raw ones: save_blocks / load_blocks only
            raise KVStoreError("invalid", f"KVStoreClient packs blocks as {LAYOUTS[0]}; namespace layout "
                               f"{namespace.layout!r} is written by another connector (kvstore.connector.vllm)")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.renew_leases = renew_leases  # keep leases and reservations alive during long transfers
        self.directory = DirectoryClient(url, timeout_s=timeout_s, token=token, ca_file=ca_file)
        self.hosts = own_hosts(hosts or ())
        self.namespace_id = self.directory.register_namespace(namespace)
        assert self.namespace_id == namespace.namespace_id, "directory computed another namespace id"
        self.agent = Agent(name or f"kvstore-client-{uuid.uuid4().hex[:12]}", backends={"UCX": {}})
        self.peers = Peers(self.agent, self.directory)
        self.copier = BlockCopier(self.agent, self.peers, LocalArenas(mode=same_host), timeout_s)
        self.pusher = Pusher(self.agent, namespace.tenant, load_push, self.hosts, timeout_s, ca_file)
        self._registered: dict[int, object] = {}  # address -> NIXL registration of memory registered here
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvstore-checksum")
        self._fetcher = ThreadPoolExecutor(FETCHES_IN_FLIGHT, thread_name_prefix="kvstore-fetch")
        self.slots = max(1, staging_bytes // namespace.block_nbytes)
        self.staging = HostBuffer(self.slots * namespace.block_nbytes)
        self.register_buffer(self.staging.array)
        self.last_timings: dict[str, float] = {}  # seconds per phase of the last *_blocks call
        self.last_refused: dict[str, int] = {}  # blocks the last save did not store, by reason
        self.last_handoff: HandoffResult | None = None  # how the last load's wait for a hand-off ended
        self.skipped: Counter = Counter()  # (call, "unreachable" | "throttled") -> calls made a miss or skipped

    # ---- tensors ----------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of `token_ids` the store can serve (a multiple of block_tokens)."""
        hashes = [h.hex() for h in block_hashes(self.namespace, token_ids)]
        if not hashes:
            return 0
        with self.miss_if_refused("lookup"):
            return self.directory.lookup(self.namespace_id, hashes).num_hit_blocks * self.namespace.block_tokens
        return 0

    def save(self, token_ids: Sequence[int], kv: LayerKV, handoff: str | None = None,
             hints: specs.RequestHints | dict | None = None) -> int:
        """Store every full block of `token_ids` not yet stored; returns the leading tokens now held.
        With `handoff`, then commit that hand-off (the consumer waiting for it loads now). `hints`
        (session_id, retain: "turn" | "session" | "none", priority) tell the store's policies what
        the request is; advisory."""
        finished_at = time.time()
        held = self._save(token_ids, kv, request_hints(hints))
        if handoff is not None:
            with self.miss_if_refused("hand-off commit"):
                self.directory.commit_handoff(HandoffCommit(namespace_id=self.namespace_id, handoff_id=handoff,
                                                            num_tokens=held, finished_at=finished_at))
        return held

    def _save(self, token_ids: Sequence[int], kv: LayerKV, hints: specs.RequestHints | None) -> int:
        tokens = np.asarray(token_ids)
        layout.check_kv(self.namespace, kv, tokens.size)
        hashes = block_hashes(self.namespace, tokens)
        held = 0
        for first in range(0, len(hashes), self.slots):
            chunk = hashes[first : first + self.slots]
            stored = self.save_blocks(chunk, self._staging_views(len(chunk)), hashes[first - 1] if first else None,
                                      hints, layout.packer(self.namespace, kv, first))
            held += stored
            if stored < len(chunk):
                break
        return held * self.namespace.block_tokens

    def load(self, token_ids: Sequence[int], wait_for: str | None = None,
             timeout: float = 30.0) -> tuple[LayerKV, int]:
        """Per-layer (K, V) [num_kv_heads, n, head_dim] of the longest verified cached prefix, and n.
        With `wait_for`, first wait up to `timeout` seconds for that hand-off (`last_handoff` says
        how the wait ended).

        Blocks go straight into tensors sized for the whole prompt: from a worker's mapped arena
        in one transposing copy each (no staging copy), from the staging buffer otherwise; a
        shorter hit returns views of their first n tokens."""
        hashes = block_hashes(self.namespace, token_ids)
        if wait_for is not None:
            self.last_handoff = wait_for_handoff(self.directory, self.namespace_id, wait_for,
                                                 [h.hex() for h in hashes], time.monotonic() + timeout)
            if self.last_handoff.outcome in ("timeout", "error"):
                log.warning("hand-off %s: %s after %.1f s%s; loading what the store has", wait_for,
                            self.last_handoff.outcome, self.last_handoff.waited_s,
                            f" ({self.last_handoff.detail})" if self.last_handoff.detail else "")
        kv = layout.empty_kv(self.namespace, len(hashes) * self.namespace.block_tokens)
        num_blocks = 0
        for first in range(0, len(hashes), self.slots):
            chunk = hashes[first : first + self.slots]
            n = self.load_blocks(chunk, self._staging_views(len(chunk)), layout.unpacker(self.namespace, kv, first))
            num_blocks += n
            if n < len(chunk):
                break
        tokens = num_blocks * self.namespace.block_tokens
        return [(k[:, :tokens], v[:, :tokens]) for k, v in kv], tokens

    def start_load_layers(self, token_ids: Sequence[int]) -> LayerwiseLoad:
        """Post the reads of every layer of the cached prefix of `token_ids` (up to the staging
        buffer's blocks) and return at once; see `kvstore.connector.layerwise`."""
        return LayerwiseLoad(self, block_hashes(self.namespace, token_ids), time.perf_counter())

    def miss_if_refused(self, what: str):
        """A context in which the directory's "unreachable" or "throttled" makes the call a miss
        (or a skipped save), counted in `skipped`, instead of an exception into the engine."""
        return calls.miss_if_refused(what, self.skipped)

    def complete_load(self, body: specs.CompleteLoad) -> bool:
        """Release a lease; False when the directory refused it as stale (the reads are then a miss)."""
        return accepted(self.directory.complete_load, body)

    def _staging_views(self, n: int) -> list[np.ndarray]:
        size = self.namespace.block_nbytes
        return [self.staging.view(i * size, size) for i in range(n)]

    # ---- blocks ----------------------------------------------------------------------

    def register_buffer(self, array: np.ndarray | torch.Tensor) -> None:
        """Register engine memory with NIXL once; blocks passed to *_blocks must lie inside it."""
        if isinstance(array, torch.Tensor):
            assert array.device.type == "cpu", "only host memory on this path (HBM is a GPU path)"
            addr, nbytes = array.data_ptr(), array.numel() * array.element_size()
        else:
            addr, nbytes = int(array.ctypes.data), array.nbytes
        self._registered[addr] = self.agent.register_dram(addr, nbytes)
        self.pusher.memory_changed()

    def release_buffer(self, array: np.ndarray | torch.Tensor) -> None:
        """Deregister memory `register_buffer` registered, once no worker can push into it any more
        (each that holds this engine's metadata is told first); then the engine may free or reuse it."""
        addr = array.data_ptr() if isinstance(array, torch.Tensor) else int(array.ctypes.data)
        if addr not in self._registered:
            raise KVStoreError("invalid", "this memory was not registered with register_buffer", addr=addr)
        self.pusher.forget()
        self.agent.deregister(self._registered.pop(addr))

    def save_blocks(self, hashes: list[bytes], blocks: list[np.ndarray], parent: bytes | None = None,
                    hints: specs.RequestHints | dict | None = None, pack: Transform | None = None) -> int:
        """Store a chain of blocks (block i's parent is block i-1); returns the leading blocks now held.
        A chain larger than the memory tier is saved in rounds: what a round commits may move down
        while the next is placed. Why blocks were not stored: `last_refused` (reason -> blocks).
        A directory that cannot be reached or throttles the call stores nothing (0), it does not raise. `pack(k, bytes of
        blocks k..)` -> copies: they make the blocks, in a mapped arena where they can, else in `blocks`."""
        assert len(hashes) == len(blocks), "one buffer per hash"
        self.last_refused, held = {}, 0
        with self.miss_if_refused("save"):
            while held < len(hashes):  # each round stores at least one block more, or ends the save
                shifted = pack and (lambda k, raw, at=held: pack(at + k, raw))
                stored, refused = self._save_blocks(hashes[held:], blocks[held:], hashes[held - 1] if held else parent,
                                                    request_hints(hints), shifted)
                held += stored
                if not stored or refused != "no_space":
                    break
        if held < len(hashes) and self.last_refused:
            log.info("saved %d of %d blocks; not stored: %s", held, len(hashes), self.last_refused)
        return held

    def _save_blocks(self, hashes: list[bytes], blocks: list[np.ndarray], parent: bytes | None,
                     hints: specs.RequestHints | None, pack: Transform | None) -> tuple[int, str | None]:
        """One prepare + write + complete; (leading blocks now held, why the next one is not)."""
        clock = PhaseClock()
        parents = [parent] + hashes[:-1]
        prepared = clock.timed("prepare", self.directory.prepare_store, specs.PrepareStore.model_validate({
            "namespace_id": self.namespace_id, "writer": self.agent.name, "hosts": self.hosts, "hints": hints,
            "blocks": [{"hash": h.hex(), "parent": p.hex() if p else None, "nbytes": b.nbytes}  # validated at once
                       for h, p, b in zip(hashes, parents, blocks)]}))
        admitted = [(i, d) for i, d in enumerate(prepared.blocks) if d.status == "admitted"]
        ok: dict[int, bool] = {}
        if admitted:
            with self._renewal(prepared.token, prepared.expires_at):
                done, sums = self._write_hashed([(blocks[i], d.location) for i, d in admitted], clock,
                                                pack and reindexed(pack, [i for i, _ in admitted], blocks[0].nbytes))
            ok = {i: done[k] for k, (i, _) in enumerate(admitted)}
            body = specs.CompleteStore.model_validate({"token": prepared.token, "blocks": [
                {"hash": d.hash, "ok": ok[i], "checksum": sums[k]} for k, (i, d) in enumerate(admitted)]})
            if not clock.timed("complete", accepted, self.directory.complete_store, body):
                ok = {}  # the reservation was gone: nothing of this call is stored
        self.last_timings = clock.finish()
        held = 0
        for i, decision in enumerate(prepared.blocks):
            if not (decision.status == "exists" or ok.get(i)):
                break
            held += 1
        if held == len(hashes):
            self.last_refused = {}
            return held, None
        reasons = [d.reason if d.status == "rejected" else "write_failed" for d in prepared.blocks[held:]
                   if d.status != "exists"]
        self.last_refused = dict(Counter(reasons))
        return held, reasons[0] if reasons else None

    def load_blocks(self, hashes: list[bytes], blocks: list[np.ndarray], unpack: Transform | None = None) -> int:
        """Read the longest cached prefix of `hashes` into `blocks`; returns how many verified.
        A prefix larger than the memory tier is read in rounds, each staged from the tiers below
        once the last was read. A directory that cannot be reached or throttles the call is a miss (0), it does not raise.
        `unpack(k, bytes of blocks k..)` -> copies: they take the blocks, out of a mapped arena where they can."""
        assert len(hashes) == len(blocks), "one buffer per hash"
        verified = 0
        with self.miss_if_refused("load"):
            while verified < len(hashes):
                shifted = unpack and (lambda k, raw, at=verified: unpack(at + k, raw))
                read, more = self._load_blocks(hashes[verified:], blocks[verified:], shifted)
                verified += read
                if not read or not more:
                    break
        return verified

    def _load_blocks(self, hashes: list[bytes], blocks: list[np.ndarray], unpack: Transform | None) -> tuple[int, int]:
        """One prepare + read + complete; (leading blocks verified, blocks stored after those that
        the memory tier could not take now: 0 unless every block read was verified)."""
        clock = PhaseClock()
        prepared = clock.timed("prepare", self._prepare_load, [h.hex() for h in hashes])
        hits = prepared.blocks
        if not hits:
            self.last_timings = clock.finish()
            return 0, 0
        with self._renewal(prepared.token, prepared.expires_at):
            done, digests = self._read_and_hash(prepared, blocks, clock, unpack)
        verified, reports = 0, []
        for i, hit in enumerate(hits):
            good = done[i] and digests[i] == hit.checksum
            if done[i] and not good:  # only a bad block is reported: its replica is invalidated
                log.warning("checksum mismatch on block %s from %s; replica invalidated", hit.hash, hit.location.worker)
                reports.append(specs.BlockRead(hash=hit.hash, ok=False))
            if good and verified == i:
                verified += 1
        body = specs.CompleteLoad(token=prepared.token, blocks=reports)
        if not clock.timed("complete", self.complete_load, body):
            verified = 0  # the lease expired under us: the pages may have been reused, so a miss
        self.last_timings = clock.finish()
        return verified, prepared.more if verified == len(hits) else 0

    def _prepare_load(self, hashes: list[str]) -> specs.LoadPrepared:
        """prepare_load, asking for push grants where this engine wants pushes; a directory from
        before pushed loads refuses the field: it is then asked without it, from now on."""
        push = self.pusher.asks()
        body = specs.PrepareLoad(namespace_id=self.namespace_id, hashes=hashes, reader=self.agent.name, push=push)
        try:
            return self.directory.prepare_load(body)
        except KVStoreError as exc:
            if not push or exc.kind != "invalid" or "push" not in str(exc.context):
                raise
        self.pusher.directory_refused()
        return self.directory.prepare_load(body.model_copy(update={"push": False}))

    def _renewal(self, token: str | None, expires_at: float | None) -> Renewal:
        ttl_s = (expires_at - time.time()) if expires_at is not None else 0.0
        return Renewal(self.directory, token if self.renew_leases and ttl_s > 0 else None, ttl_s)

    def _write_hashed(self, items: list[tuple[np.ndarray, specs.ReplicaLocation]], clock: "PhaseClock",
                      pack: Transform | None = None):
        """Per item (written, xxh3_64 of its bytes): packed into their buffers first (with `pack`),
        then same-host items copied and hashed chunk by chunk, from the buffer (what this engine
        meant to write, never what the arena holds once copied); the others hashed on the helper
        thread while NIXL writes."""
        if pack is not None:
            clock.timed("pack", self.copier.transform_buffers, list(enumerate(item[0] for item in items)), pack)
        done, sums, far = clock.timed("transfer", self.copier.copy_local, "WRITE", items)
        if far:
            hashing = self._hasher.submit(lambda: [checksum(items[k][0]) for k in far])
            written = clock.timed("transfer", self._move, "WRITE", [items[k] for k in far])
            scatter(far, written, clock.timed("checksum", hashing.result), done, sums)  # the wait beyond it
        return done, sums

    def _read_and_hash(self, prepared: specs.LoadPrepared, blocks: list[np.ndarray], clock: "PhaseClock",
                       unpack: Transform | None = None):
        """Per block (read ok, xxh3_64 of what arrived). Same-host blocks are copied and hashed chunk
        by chunk (or, with `unpack`, read in place); the others are pushed by their workers or read
        over NIXL in groups of about READ_GROUP_BYTES, group k hashed on the helper thread while
        group k+1 arrives (FETCHES_IN_FLIGHT groups of a pushed load travel at once, so that the
        link does not idle between two pushes), and then unpacked."""
        items = [(blocks[i], hit.location) for i, hit in enumerate(prepared.blocks)]
        if unpack is None:
            done, digests, far = clock.timed("transfer", self.copier.copy_local, "READ", items)
        else:
            done, digests, far = clock.timed("transfer", self.copier.in_place, items, unpack)
        hashing, in_flight = [], deque()
        window = FETCHES_IN_FLIGHT if prepared.grants and self.pusher.wanted(prepared) else 1

        def arrived() -> None:  # the oldest group in flight is here: hashed on the helper thread
            ks, fetching = in_flight.popleft()
            read = clock.timed("transfer", fetching.result)
            hashing.append((ks, read, self._hasher.submit(lambda: [checksum(blocks[k]) for k in ks])))
        try:
            for group in groups([blocks[k].nbytes for k in far], READ_GROUP_BYTES):
                if len(in_flight) == window:
                    arrived()
                ks = [far[g] for g in group]
                in_flight.append((ks, self._fetcher.submit(self._fetch, prepared, [items[k] for k in ks])))
            while in_flight:
                arrived()
        finally:  # nothing still writes into the blocks once this returns, an exception or not
            wait([fetching for _, fetching in in_flight])
        for ks, read, future in hashing:
            scatter(ks, read, clock.timed("checksum", future.result), done, digests)
        if unpack is not None:
            self.copier.transform_buffers([(k, blocks[k]) for k in far if done[k]], unpack)
        return done, digests

    def _move(self, op: str, items: list[tuple[np.ndarray, specs.ReplicaLocation]]) -> list[bool]:
        return self.copier.move(op, items)

    def _fetch(self, prepared: specs.LoadPrepared, items: list[tuple[np.ndarray, specs.ReplicaLocation]]
               ) -> list[bool]:
        """Items pushed by the workers that granted it, the rest (and failed pushes) read over NIXL."""
        done, rest = self.pusher.push(prepared, items) if prepared.grants else ([False] * len(items),
                                                                                 list(range(len(items))))
        for k, ok in zip(rest, self._move("READ", [items[k] for k in rest]) if rest else []):
            done[k] = ok
        return done

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        self.pusher.forget()
        self.pusher.close()
        self.peers.close()
        self.copier.close()
        self.agent.close()
        self.directory.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
