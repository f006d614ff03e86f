"""Who the workers are: registration (with restart reconciliation), heartbeats, death, leaving.

    register_worker(reg) -> epoch     # a new epoch; memory tiers start empty; durable tiers reconciled
    heartbeat(name, epoch)            # a stale epoch is a conflict: register again
    declare_dead(tx, now)             # the reaper: silence beyond heartbeat_timeout_s
    deregister(name, epoch)           # a clean stop
"""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.directory import repository as repo
from kvstore.directory.models import Tier, Worker
from kvstore.directory.models.replica import READY, WRITING

if TYPE_CHECKING:
    from kvstore.directory.service import Tx

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, service) -> None:
        self.service = service  # DirectoryService: transactions, settings, worker calls

    def register_worker(self, reg: specs.WorkerRegistration) -> specs.Registered:
        now = self.service._clock()
        with self.service._tx() as tx:
            worker = repo.worker_by_name(tx.session, reg.name)
            if worker is None:
                worker = Worker(name=reg.name, epoch=0, registered_at=now)
                tx.session.add(worker)
            worker.epoch += 1
            worker.agent_name, worker.pid = reg.agent_name, reg.pid
            worker.agent_metadata = base64.b64decode(reg.agent_metadata)
            worker.control_url, worker.backends = reg.control_url, list(reg.backends)
            worker.state, worker.heartbeat_at = "active", now
            tx.session.flush()
            self.drop_volatile(tx, worker)
            self._upsert_tiers(tx, worker, reg.tiers)
            tx.session.flush()
            self._reconcile(tx, worker, reg.inventory, now)
            epoch = worker.epoch
        log.info("worker %s registered with epoch %d", reg.name, epoch)
        return specs.Registered(worker=reg.name, epoch=epoch,
                                heartbeat_interval_s=self.service.settings.heartbeat_interval_s)

    def _upsert_tiers(self, tx: Tx, worker: Worker, tiers: list[specs.TierSpec]) -> None:
        existing = repo.tiers_of(tx.session, worker.id)
        for spec in tiers:
            tier = existing.get(spec.kind) or Tier(worker_id=worker.id, kind=spec.kind, used_bytes=0)
            tier.capacity_bytes, tier.page_bytes, tier.base_addr = spec.capacity_bytes, spec.page_bytes, spec.base_addr
            tier.high_watermark, tier.low_watermark = spec.high_watermark, spec.low_watermark
            tx.session.add(tier)

    def _reconcile(self, tx: Tx, worker: Worker, inventory: list[specs.Survivor], now: float) -> None:
        """A (re)starting worker reports what its durable tiers hold: keep what it still has,
        forget what it lost, adopt what the directory did not know (its namespace must be known)."""
        found = {_survivor_key(s.kind, s.token, s.runs, s.namespace_id, s.hash): s for s in inventory}
        tiers = repo.tiers_of(tx.session, worker.id)
        lost = []
        for replica, tier, block in repo.durable_replicas_of_worker(tx.session, worker.id):
            key = _survivor_key(tier.kind, replica.token, replica.pages, block.namespace_id, block.hash)
            if found.pop(key, None) is None or replica.state == WRITING:
                lost.append(replica.id)
            else:
                replica.epoch = worker.epoch
        repo.drop_replicas(tx.session, lost)
        adopted = [s for s in found.values() if s.kind in tiers and s.checksum
                   and repo.namespace(tx.session, s.namespace_id)]
        for survivor in adopted:
            self._adopt(tx, worker, tiers[survivor.kind], survivor, now)
        # pages of unknown blocks go back; unknown objects stay in the bucket (they may be another's)
        unknown = [(s.token, s.runs) for s in found.values() if s not in adopted and s.kind != "s3"]
        tx.after_commit.append(self.service._free_later(worker.control_url, unknown))
        tx.session.flush()
        for tier in tiers.values():
            repo.recompute_used(tx.session, tier)
        if lost or found:
            log.info("worker %s: %d durable replicas lost, %d adopted, %d unknown freed",
                     worker.name, len(lost), len(adopted), len(unknown))

    def _adopt(self, tx: Tx, worker: Worker, tier: Tier, survivor: specs.Survivor, now: float) -> None:
        blocks = repo.blocks_by_hash(tx.session, survivor.namespace_id, [survivor.hash])
        if survivor.hash not in blocks:
            ids = repo.insert_blocks(tx.session, [dict(
                namespace_id=survivor.namespace_id, hash=survivor.hash, parent=None, depth=0,
                nbytes=survivor.nbytes, checksum=survivor.checksum, created_at=now, last_access=now, hit_count=0)])
            block_id = ids[survivor.hash]
        else:
            block_id = blocks[survivor.hash].id
        repo.insert_replicas(tx.session, [dict(
            block_id=block_id, tier_id=tier.id, epoch=worker.epoch, state=READY, token=survivor.token,
            pages=[[r.first, r.count] for r in survivor.runs], reserved_bytes=sum(r.count for r in survivor.runs)
            * tier.page_bytes, expires_at=None, created_at=now)])

    def drop_volatile(self, tx: Tx, worker: Worker) -> None:
        """The worker's memory tiers start empty in a new epoch: forget what they held."""
        rows = repo.volatile_replicas_of_worker(tx.session, worker.id)
        for replica, tier in rows:
            tier.used_bytes -= replica.reserved_bytes
        block_ids = [r.block_id for r, _ in rows]
        repo.drop_replicas(tx.session, [r.id for r, _ in rows])
        repo.delete_orphan_blocks(tx.session, block_ids)

    def heartbeat(self, name: str, epoch: int) -> None:
        with self.service._tx() as tx:
            worker = repo.worker_by_name(tx.session, name)
            if worker is None or worker.epoch != epoch or worker.state == "dead":
                raise KVStoreError("conflict", "unknown worker or stale epoch; register again",
                                   worker=name, epoch=epoch)  # a draining or drained worker keeps beating
            worker.heartbeat_at = self.service._clock()

    def deregister(self, name: str, epoch: int) -> None:
        """A worker leaving cleanly: its memory tiers go with it, at once."""
        with self.service._tx() as tx:
            worker = repo.worker_by_name(tx.session, name)
            if worker is None or worker.epoch != epoch:
                raise KVStoreError("conflict", "unknown worker or stale epoch", worker=name, epoch=epoch)
            worker.state = "dead"
            self.drop_volatile(tx, worker)
        log.info("worker %s (epoch %d) deregistered", name, epoch)

    def workers(self) -> list[specs.WorkerInfo]:
        with self.service._tx() as tx:
            return [_worker_info(w, with_metadata=False) for w in repo.workers(tx.session)]

    def worker(self, name: str) -> specs.WorkerInfo:
        with self.service._tx() as tx:
            return _worker_info(self._named(tx, name), with_metadata=True)

    def drain(self, name: str) -> specs.WorkerInfo:
        """No new placements; the reaper moves its memory tiers down (and NVMe to S3 when it has S3),
        waits for its pins to go (they expire with their leases), then marks it drained."""
        with self.service._tx() as tx:
            worker = self._named(tx, name)
            if worker.state in ("dead", "drained"):
                raise KVStoreError("conflict", f"worker {name!r} is {worker.state}; nothing to drain", worker=name)
            if worker.state == "active":
                worker.state = "draining"
                log.info("worker %s (epoch %d) draining", name, worker.epoch)
            return _worker_info(worker, with_metadata=False)

    def undrain(self, name: str) -> specs.WorkerInfo:
        with self.service._tx() as tx:
            worker = self._named(tx, name)
            if worker.state != "draining" and worker.state != "active":
                raise KVStoreError("conflict", f"worker {name!r} is {worker.state}: only a drain that has not "
                                   "finished can be reversed (a drained worker registers again)", worker=name)
            worker.state = "active"
            log.info("worker %s (epoch %d) active again", name, worker.epoch)
            return _worker_info(worker, with_metadata=False)

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
            if worker.state != "dead" and now - worker.heartbeat_at > self.service.settings.heartbeat_timeout_s:
                log.warning("worker %s missed heartbeats for %.1fs: dead", worker.name, now - worker.heartbeat_at)
                worker.state = "dead"
                self.drop_volatile(tx, worker)
                dead += 1
        return dead


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
