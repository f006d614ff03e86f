"""Who the workers are: registration (with restart reconciliation), heartbeats, death, leaving.

    register_worker(reg, owner) -> epoch   # a new epoch; memory tiers start empty; durable tiers reconciled;
                                      # the worker's memory tiers are granted to this directory (page credit);
                                      # a live worker's name is refused to another owner (token)
    grant(worker_id)                  # ask a worker for page credit (registration, and the reaper's retries)
    heartbeat(name, epoch, owner)     # a stale epoch is a conflict: register again
    declare_dead(tx, now)             # the reaper: silence beyond heartbeat_timeout_s
    excuse(tx, now)                   # the directory or its database was away: every live worker heard from now
    deregister(name, epoch, owner)    # a clean stop
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Callable

from kvstore.core import specs, tiers
from kvstore.core.errors import KVStoreError
from kvstore.directory.db import direct, repository as repo
from kvstore.directory.db.models import Tier, Worker
from kvstore.directory.db.models.replica import WRITING
from kvstore.directory.workers.credit import PagePools
from kvstore.directory.workers.reclaim import Reclaim
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.workers.calls import WorkerCalls
from kvstore.directory.db.writer import Tx, Write

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, write: Write, calls: WorkerCalls, reclaim: Reclaim, pools: PagePools, settings: DirectorySettings,
                 clock: Callable[[], float], block_ids: Callable[[str, list[str]], dict[str, int]]) -> None:
        self._write = write
        self._block_ids = block_ids  # the lookup index's (namespace, hashes) -> {hash: id}: no SQL index has them
        self._calls = calls
        self._reclaim = reclaim
        self._pools = pools
        self._settings = settings
        self._clock = clock
        self._beats: dict[str, float] = {}  # worker name -> when this directory last heard from it

    def register_worker(self, reg: specs.WorkerRegistration, owner: str = "") -> specs.Registered:
        try:
            metadata = base64.b64decode(reg.agent_metadata, validate=True)
        except ValueError:
            raise KVStoreError("invalid", "agent_metadata is not base64", worker=reg.name) from None
        kinds = [t.kind for t in reg.tiers]
        if len(set(kinds)) != len(kinds):
            raise KVStoreError("invalid", f"a worker has at most one tier of each kind, not {kinds}", worker=reg.name)
        holder = self._write(lambda tx: self._holder(tx, reg.name, self._clock()))
        if holder and holder != reg.control_url and self._calls.answers(holder):
            raise KVStoreError("conflict", f"worker name {reg.name!r} is held by a live worker at {holder}, which "
                               "still answers: give this worker another --name", worker=reg.name)
        worker_id, epoch = self._write(lambda tx: self._register(tx, reg, metadata, owner, self._clock()))
        self._calls.authorize(reg.control_url, reg.control_secret)
        self._beats[reg.name] = self._clock()
        log.info("worker %s registered with epoch %d", reg.name, epoch)
        self.grant(worker_id)
        return specs.Registered(worker=reg.name, epoch=epoch, heartbeat_interval_s=self._settings.heartbeat_interval_s)

    def _holder(self, tx: Tx, name: str, now: float) -> str | None:
        """The control URL of the live worker that holds `name`, if one does."""
        worker = repo.worker_by_name(tx.session, name)
        return worker.control_url if worker is not None and self._alive(worker, now) else None

    def _register(self, tx: Tx, reg: specs.WorkerRegistration, metadata: bytes, owner: str,
                  now: float) -> tuple[int, int]:
        if reg.control_url and any(w.owner != owner and w.name != reg.name and self._alive(w, now)
                                   for w in repo.workers_at(tx.session, reg.control_url)):
            raise KVStoreError("conflict", f"{reg.control_url} is the endpoint of a live worker registered with "
                               "another token", worker=reg.name)
        worker = repo.worker_by_name(tx.session, reg.name)
        if worker is None:
            worker = repo.new_worker(tx.session, reg.name, now)
        elif worker.owner != owner and self._alive(worker, now):
            raise KVStoreError("conflict", f"worker name {reg.name!r} is held by a live worker registered with "
                               "another token", worker=reg.name)
        worker.owner, worker.control_secret = owner, reg.control_secret
        worker.epoch += 1
        worker.agent_name, worker.pid = reg.agent_name, reg.pid
        worker.agent_metadata = metadata
        worker.control_url, worker.backends = reg.control_url, list(reg.backends)
        worker.state, worker.heartbeat_at = "active", now
        repo.flush(tx.session)
        self.drop_volatile(tx, worker)
        self._upsert_tiers(tx, worker, reg.tiers)
        repo.flush(tx.session)
        self._reconcile(tx, worker, reg.inventory, now)
        return worker.id, worker.epoch

    def _alive(self, worker: Worker, now: float) -> bool:
        return worker.state != "dead" and now - worker.heartbeat_at <= self._settings.heartbeat_timeout_s

    def grant(self, worker_id: int) -> None:
        """Ask the worker for every free page of its memory tiers it has not granted us in this epoch,
        record the grant, and put the pages in the pool. A worker that cannot be reached is asked
        again by the reaper."""
        wanted = self._write(lambda tx: self._wanted_grants(tx, worker_id))
        for url, epoch, tier_id, kind, page_bytes, pages in wanted:
            token = "grant-" + secrets.token_hex(8)
            try:
                runs = self._calls.grant(url, kind, token, pages)
            except KVStoreError as exc:
                log.warning("worker at %s did not grant pages of its %s tier: %s", url, kind, exc)
                continue
            if runs:
                self._write(lambda tx: self._record_grant(tx, worker_id, epoch, tier_id, page_bytes, token, runs))

    def _wanted_grants(self, tx: Tx, worker_id: int) -> list[tuple]:
        worker = repo.worker(tx.session, worker_id)
        if worker is None or worker.state != "active":
            return []
        wanted = []
        for tier in repo.tiers_of(tx.session, worker_id).values():
            if tier.kind in tiers.MEMORY and tier.capacity_bytes:
                pages = tier.capacity_bytes // tier.page_bytes - self._pools.granted_bytes(tier.id, worker.epoch) \
                    // tier.page_bytes
                if pages > 0:
                    wanted.append((worker.control_url, worker.epoch, tier.id, tier.kind, tier.page_bytes, pages))
        return wanted

    def _record_grant(self, tx: Tx, worker_id: int, epoch: int, tier_id: int, page_bytes: int, token: str,
                      runs: list[specs.PageRun]) -> None:
        worker = repo.worker(tx.session, worker_id)
        if worker is None or worker.epoch != epoch:
            return  # the worker restarted meanwhile: those pages are void
        repo.add_grant(tx.session, tier_id, epoch, token, [[r.first, r.count] for r in runs], self._clock())
        tx.after_commit.append(lambda: self._pools.add(tier_id, epoch, page_bytes, runs))

    def ungranted(self) -> list[int]:
        """Active workers with a memory tier this directory holds no page credit for (the reaper retries)."""
        def job(tx: Tx) -> list[int]:
            ids = set()
            for kind in tiers.MEMORY:
                for tier, worker in repo.active_tiers(tx.session, kind):
                    if tier.capacity_bytes and not self._pools.granted_bytes(tier.id, worker.epoch):
                        ids.add(worker.id)
            return sorted(ids)
        return self._write(job)

    def _upsert_tiers(self, tx: Tx, worker: Worker, tiers: list[specs.TierSpec]) -> None:
        existing = repo.tiers_of(tx.session, worker.id)
        for spec in tiers:
            tier = repo.tier_row(tx.session, existing, worker.id, spec.kind)
            tier.capacity_bytes, tier.page_bytes, tier.base_addr = spec.capacity_bytes, spec.page_bytes, spec.base_addr
            tier.device = spec.device
            tier.high_watermark, tier.low_watermark = spec.high_watermark, spec.low_watermark

    def _reconcile(self, tx: Tx, worker: Worker, inventory: list[specs.Survivor], now: float) -> None:
        """A (re)starting worker reports what its durable tiers hold: keep what it still has,
        forget what it lost, adopt what the directory did not know (its namespace must be known)."""
        found = {_survivor_key(s.kind, s.token, s.runs, s.namespace_id, s.hash): s for s in inventory}
        own = repo.tiers_of(tx.session, worker.id)
        lost = []
        for replica, tier, block in repo.durable_replicas_of_worker(tx.session, worker.id):
            key = _survivor_key(tier.kind, replica.token, replica.pages, block.namespace_id, block.hash)
            if found.pop(key, None) is None or replica.state == WRITING:
                lost.append((replica.id, block.id))
            else:
                replica.epoch = worker.epoch
        repo.drop_replicas(tx.session, [replica_id for replica_id, _ in lost])
        repo.delete_orphan_blocks(tx.session, [block_id for _, block_id in lost])  # their last replica
        adopted = [s for s in found.values() if s.kind in own and s.checksum and _covers(s, own[s.kind])
                   and repo.namespace(tx.session, s.namespace_id)]
        for survivor in adopted:
            self._adopt(tx, worker, own[survivor.kind], survivor, now)
        # pages of unknown blocks go back; unknown objects stay in the bucket (they may be another's)
        unknown = [(s.token, s.runs) for s in found.values() if s not in adopted and s.kind != "s3"]
        tx.after_commit.append(self._calls.free_later(worker.control_url, unknown))
        repo.flush(tx.session)
        for tier in own.values():
            repo.recompute_used(tx.session, tier)
        if lost or found:
            log.info("worker %s: %d durable replicas lost, %d adopted, %d unknown freed",
                     worker.name, len(lost), len(adopted), len(unknown))

    def _adopt(self, tx: Tx, worker: Worker, tier: Tier, survivor: specs.Survivor, now: float) -> None:
        there = direct.still_there(tx.session, self._block_ids(survivor.namespace_id, [survivor.hash]))
        block_id = there.get(survivor.hash) or direct.insert_blocks(tx.session, survivor.namespace_id, [
            (survivor.hash, None, 0, survivor.nbytes, survivor.checksum)], now)[survivor.hash]
        pages = [[r.first, r.count] for r in survivor.runs]
        direct.insert_replicas(tx.session, [(block_id, tier.id, worker.epoch, survivor.token, pages,
                                           sum(r.count for r in survivor.runs) * tier.page_bytes, now)])
        repo.touched(tx.session, [block_id])

    def drop_volatile(self, tx: Tx, worker: Worker) -> None:
        """The worker's memory tiers start empty in a new epoch: forget what they held (and the
        page credit they gave)."""
        rows = repo.volatile_replicas_of_worker(tx.session, worker.id)
        used: dict[int, int] = {}
        for replica, tier in rows:
            used[tier.id] = used.get(tier.id, 0) - replica.reserved_bytes
        repo.add_used(tx.session, used)
        repo.drop_replicas(tx.session, [r.id for r, _ in rows])
        repo.delete_orphan_blocks(tx.session, [r.block_id for r, _ in rows])
        memory = [t.id for t in repo.tiers_of(tx.session, worker.id).values() if t.kind in tiers.MEMORY]
        repo.drop_grants(tx.session, memory)
        tx.after_commit.append(lambda: [self._pools.forget(t) for t in memory])

    def heartbeat(self, name: str, epoch: int, owner: str = "") -> None:
        def job(tx: Tx) -> None:
            worker = _owned(repo.worker_by_name(tx.session, name), owner)
            if worker is None or worker.epoch != epoch or worker.state == "dead":
                raise KVStoreError("conflict", "unknown worker or stale epoch; register again",
                                   worker=name, epoch=epoch)  # a draining or drained worker keeps beating
            worker.heartbeat_at = self._clock()
        self._write(job)
        self._beats[name] = self._clock()

    def deregister(self, name: str, epoch: int, owner: str = "") -> None:
        """A worker leaving cleanly: its memory tiers go with it, at once."""
        def job(tx: Tx) -> None:
            worker = _owned(repo.worker_by_name(tx.session, name), owner)
            if worker is None or worker.epoch != epoch:
                raise KVStoreError("conflict", "unknown worker or stale epoch", worker=name, epoch=epoch)
            worker.state = "dead"
            self.drop_volatile(tx, worker)
        self._write(job)
        self._beats.pop(name, None)
        log.info("worker %s (epoch %d) deregistered", name, epoch)

    def workers(self) -> list[specs.WorkerInfo]:
        return self._write(lambda tx: [_worker_info(w, with_metadata=False) for w in repo.workers(tx.session)])

    def worker(self, name: str) -> specs.WorkerInfo:
        return self._write(lambda tx: _worker_info(self._named(tx, name), with_metadata=True))

    def drain(self, name: str) -> specs.WorkerInfo:
        """No new placements; the reaper moves its memory tiers down (and NVMe to S3 when it has S3),
        waits for its pins to go (they expire with their leases), then marks it drained."""
        def job(tx: Tx) -> specs.WorkerInfo:
            worker = self._named(tx, name)
            if worker.state in ("dead", "drained"):
                raise KVStoreError("conflict", f"worker {name!r} is {worker.state}; nothing to drain", worker=name)
            if worker.state == "active":
                worker.state = "draining"
                log.info("worker %s (epoch %d) draining", name, worker.epoch)
            return _worker_info(worker, with_metadata=False)
        return self._write(job)

    def undrain(self, name: str) -> specs.WorkerInfo:
        def job(tx: Tx) -> specs.WorkerInfo:
            worker = self._named(tx, name)
            if worker.state != "draining" and worker.state != "active":
                raise KVStoreError("conflict", f"worker {name!r} is {worker.state}: only a drain that has not "
                                   "finished can be reversed (a drained worker registers again)", worker=name)
            worker.state = "active"
            log.info("worker %s (epoch %d) active again", name, worker.epoch)
            return _worker_info(worker, with_metadata=False)
        return self._write(job)

    def finish_drains(self, tx: Tx) -> list[int]:
        """Draining workers whose memory tiers hold nothing any more become drained; returns the ids of
        those still draining."""
        still = []
        for worker in repo.workers(tx.session):
            if worker.state != "draining":
                continue
            if repo.volatile_replicas_of_worker(tx.session, worker.id):
                still.append(worker.id)
                continue
            worker.state = "drained"
            log.info("worker %s (epoch %d) drained: it holds no memory-tier blocks; it may be stopped",
                     worker.name, worker.epoch)
        return still

    def _named(self, tx: Tx, name: str) -> Worker:
        worker = repo.worker_by_name(tx.session, name)
        if worker is None:
            raise KVStoreError("not_found", f"no worker named {name!r}", worker=name)
        return worker

    def declare_dead(self, tx: Tx, now: float) -> int:
        dead = 0
        for worker in repo.workers(tx.session):
            if worker.state != "dead" and now - worker.heartbeat_at > self._settings.heartbeat_timeout_s:
                log.warning("worker %s missed heartbeats for %.1fs: dead", worker.name, now - worker.heartbeat_at)
                worker.state = "dead"
                self.drop_volatile(tx, worker)
                self._beats.pop(worker.name, None)
                dead += 1
        return dead

    def excuse(self, tx: Tx, now: float) -> None:
        """Every live worker counts as heard from at `now`: the directory (or its database) was away,
        and that silence was not the workers'."""
        for worker in repo.workers(tx.session):
            if worker.state != "dead":
                worker.heartbeat_at = max(worker.heartbeat_at, now)

    def forget_beats(self) -> None:
        """A replica that stopped leading hears no heartbeats: what it heard would count stale workers live."""
        self._beats.clear()

    def live_count(self) -> int:
        """Workers heard from (registration or heartbeat) within the heartbeat timeout by this
        directory, without a read of the database: what /readyz counts."""
        now = self._clock()
        return sum(now - beat <= self._settings.heartbeat_timeout_s for beat in list(self._beats.values()))


def _owned(worker: Worker | None, owner: str) -> Worker | None:
    """The worker if `owner` registered it; else None, so that a caller learns no more about another
    token's worker than about a name nobody holds."""
    return worker if worker is not None and worker.owner == owner else None


def _covers(survivor: specs.Survivor, tier: Tier) -> bool:
    """Its pages hold its bytes (an S3 object is one whole block)."""
    return survivor.kind == "s3" or sum(r.count for r in survivor.runs) * tier.page_bytes >= survivor.nbytes


def _survivor_key(kind: str, token: str, runs, namespace_id: str, block_hash: str) -> tuple:
    """Objects are named by their block; pages by the token and runs they were written under."""
    if kind == "s3":
        return (kind, f"{namespace_id}/{block_hash}")
    return (kind, token, tuple((r.first, r.count) if hasattr(r, "first") else tuple(r) for r in runs))


def _worker_info(worker: Worker, with_metadata: bool) -> specs.WorkerInfo:
    return specs.WorkerInfo(
        name=worker.name, agent_name=worker.agent_name, epoch=worker.epoch, state=worker.state,
        pid=worker.pid, control_url=worker.control_url, backends=list(worker.backends),
        last_heartbeat=worker.heartbeat_at,
        agent_metadata=base64.b64encode(worker.agent_metadata).decode() if with_metadata else None)
