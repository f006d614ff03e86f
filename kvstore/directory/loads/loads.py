"""Loads: lookup (from memory), prepare_load -> (the engine reads) -> complete_load.

    loads.lookup(namespace_id, hashes, locations) -> body   # the index only: no lock, no SQL
    loads.prepare(namespace_id, chains, reader) -> body     # pins under one lease; NVMe/S3 hits staged first
    loads.complete(req) -> LoadCompleted                    # unpins; a block reported bad is invalidated if
                                                            # its worker confirms the mismatch
    loads.flush_accesses()                                  # the reaper: access statistics to SQL and policies

Answers are plain dicts and lists, encoded once by the HTTP layer: a hot call
builds no model per block.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable

from kvstore.core import push, specs, tiers
from kvstore.core.errors import KVStoreError
from kvstore.directory.db import loads as sql
from kvstore.directory.db import repository as repo
from kvstore.directory.db.index import Index
from kvstore.directory.db import views
from kvstore.directory.db.views import Hit
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.db.models.replica import DELETING
from kvstore.directory.tier_policies import TierPolicies, block_key
from kvstore.directory.workers.reclaim import Reclaim
from kvstore.directory.settings import DirectorySettings
from kvstore.directory.db.writer import Tx, Write


log = logging.getLogger(__name__)
PROMOTION_ROUNDS = 3  # stagings of one prepare_load, when blocks move between tiers meanwhile
STATS_ROWS_PER_FLUSH = 2000  # access statistics written per reaper tick: the writer is never held long
WARN_EVERY_S = 10.0  # a warning that could come with every load, at most this often
VERIFIED_PER_CALL = 64  # blocks one load's completion may have their workers check (the rest are kept)
POLICY_HITS_AT_ONCE = 2000  # blocks whose hits go to the policies under one hold of their lock


class Loads:
    def __init__(self, write: Write, index: Index, promote: Callable[[list[Hit]], object], reclaim: Reclaim,
                 policies: TierPolicies, metrics: DirectoryMetrics, settings: DirectorySettings,
                 clock: Callable[[], float], verify: Callable[[str, list[tuple]], list],
                 secret: Callable[[str], str | None] = lambda url: None) -> None:
        self._write = write
        self._index = index
        self._promote = promote  # stage NVMe/S3-only hits into a memory tier (worker I/O, outside jobs)
        self._reclaim = reclaim
        self._policies = policies
        self._metrics = metrics
        self._settings = settings
        self._clock = clock
        self._verify = verify  # (worker url, replicas) -> per replica: bytes intact? (None: cannot say)
        self._secret = secret  # a worker's control URL -> the secret that signs its push grants
        self._pending_stats: dict[int, tuple[float, int]] = {}  # block id -> (last access, hits), for SQL
        self._warned = -WARN_EVERY_S

    def lookup(self, namespace_id: str, hashes: list[str], locations: bool) -> dict:
        if not locations:
            hit, kinds, runs = self._index.count(namespace_id, hashes)
            self._metrics.count_lookup(len(hashes), hit)
            return {"num_hit_blocks": hit, "blocks": [], "by_tier": kinds, "tier_runs": runs}
        hits = self._index.lookup(namespace_id, hashes)
        self._metrics.count_lookup(len(hashes), len(hits))
        return {"num_hit_blocks": len(hits), "blocks": [hit_body(h) for h in hits], "by_tier": by_tier(hits),
                "tier_runs": tiers.tier_runs(h.tier.kind for h in hits)}

    def prepare(self, namespace_id: str, chains: list[list[str]], reader: str,
                pushes: tuple[str, str] | None = None) -> dict:
        """Pin the leading hits an engine can read of every chain, under one token (a block that
        chains share is pinned once). NVMe/S3-only hits are staged into memory first. With `pushes`
        (the namespace's tenant, the caller's credential id), the answer's "grants" let `reader`
        have the workers push the DRAM hits."""
        found = [self._index.lookup(namespace_id, c) for c in chains]
        for _ in range(PROMOTION_ROUNDS):  # a block may move down (or up) while it is being staged
            staged = [h for hits in found for h in hits if h.tier.kind not in tiers.ENGINE_READABLE]
            if not staged:
                break
            self._promote([h for hits in found for h in hits])
            before = {h.replica_id for h in staged}
            found = [self._index.lookup(namespace_id, c) for c in chains]
            if {h.replica_id for hits in found for h in hits if h.tier.kind not in tiers.ENGINE_READABLE} >= before:
                if time.monotonic() - self._warned > WARN_EVERY_S:  # a full tier would warn at every load
                    self._warned = time.monotonic()
                    log.warning("%d blocks of a load found no room in a memory tier; read as a miss", len(before))
                break  # nothing of it was staged: the memory tier cannot take it now
        readable = [_readable_prefix(hits) for hits in found]
        more = [len(hits) - len(r) for hits, r in zip(found, readable)]  # stored below, not staged now
        found = readable
        wanted = list({h.replica_id: None for hits in found for h in hits})
        if not wanted:
            return {"token": None, "expires_at": None, "chains": [[] for _ in chains], "more": more}
        token = secrets.token_hex(16)
        expires_at = self._clock() + self._settings.lease_ttl_s
        pinned = self._write(lambda tx: sql.pin(tx.session, wanted, token, reader, expires_at))
        found = [_pinned_prefix(hits, pinned) for hits in found]
        for asked, hits in zip(chains, found):
            self._metrics.count_lookup(len(asked), len(hits))
            self._index.record([h.entry for h in hits])
        bodies = [[hit_body(h) for h in hits] for hits in found]
        answer = {"token": token if pinned else None, "expires_at": expires_at if pinned else None,
                  "chains": bodies, "more": more}
        if pinned and pushes is not None:
            answer["grants"] = self._grants([(h, body["location"]) for hits, said in zip(found, bodies)
                                             for h, body in zip(hits, said)], *pushes, reader, token, expires_at)
        return answer

    def _grants(self, hits: list[tuple[Hit, dict]], tenant: str, owner: str, reader: str, token: str,
                expires_at: float) -> list[dict]:
        """Per worker holding DRAM hits (each with the location the answer gives it), a grant over
        their runs in the order of the hits (a block chains share once): what `kvstore.core.push`
        says the worker checks. None for a reader that names a worker's NIXL agent: a worker would
        take the engine's metadata for its peer's."""
        if any(w.agent_name == reader for w in list(self._index.workers.values())):
            return []
        runs: dict[tuple[str, int], list] = {}
        workers = {}
        seen = set()
        for hit, location in hits:
            if hit.tier.kind != "dram" or hit.replica_id in seen:
                continue
            seen.add(hit.replica_id)
            key = (hit.worker.name, hit.worker.epoch)
            workers[key] = hit.worker
            runs.setdefault(key, []).extend(location["runs"])
        grants = []
        for (name, epoch), worker_runs in runs.items():
            secret = self._secret(workers[name, epoch].control_url)
            if not secret or len(worker_runs) > push.MAX_PUSH_RUNS:  # the engine reads these itself
                continue
            grants.append({"worker": name, "epoch": epoch, "control_url": workers[name, epoch].control_url,
                           "owner": owner, "expires_at": expires_at,
                           "grant": push.lease_grant(secret, name, epoch, tenant, owner, reader, token, expires_at,
                                                     worker_runs),
                           "engine_key": push.engine_key(secret, name, epoch, tenant, owner, reader)})
        return grants

    def complete(self, req: specs.CompleteLoad) -> specs.LoadCompleted:
        reported = list(dict.fromkeys(b.hash for b in req.blocks if not b.ok))
        if len(reported) > VERIFIED_PER_CALL:  # a reader cannot make workers hash without bound
            log.warning("a reader reported %d blocks bad in one load; the first %d are checked, the rest kept",
                        len(reported), VERIFIED_PER_CALL)
        failed = set(reported[:VERIFIED_PER_CALL])
        if failed:  # a reader's word alone invalidates nothing: the worker checks the bytes first
            failed = self._confirmed(req.token, failed)

        def release(tx: Tx) -> tuple[int, int]:  # every block read well: the leases go, nothing else
            released, deleting = sql.release(tx.session, req.token)
            if not released:
                raise KVStoreError("conflict", "unknown or expired lease token", token=req.token)
            if deleting:
                self._reclaim.collect_deleting(tx)
            return released, 0

        def job(tx: Tx) -> tuple[int, int]:
            pinned = repo.pinned_by_token(tx.session, req.token)
            if not pinned:
                raise KVStoreError("conflict", "unknown or expired lease token", token=req.token)
            invalidated = 0
            for replica, block in pinned:
                if block.hash in failed and replica.state != DELETING:
                    replica.state = DELETING  # no new pins; pages freed when the last pin goes
                    invalidated += 1
            repo.delete_leases(tx.session, req.token)
            if invalidated or any(r.state == DELETING for r, _ in pinned):
                self._reclaim.collect_deleting(tx)
            return len(pinned), invalidated

        released, invalidated = self._write(job if failed else release)
        self._metrics.checksum_failures.inc(invalidated)
        return specs.LoadCompleted(released=released, invalidated=invalidated)

    def _confirmed(self, token: str, reported: set[str]) -> set[str]:
        """The reported blocks whose worker finds their pinned replica's bytes no longer match the
        checksum. Asked outside every job; the lease still pins the replicas meanwhile."""
        suspects = self._write(lambda tx: repo.pinned_suspects(tx.session, token, sorted(reported)))
        by_worker: dict[str, list] = {}
        for suspect in suspects:
            if suspect.current and suspect.checksum:
                by_worker.setdefault(suspect.worker_url, []).append(suspect)
        confirmed = set()
        for url, group in by_worker.items():
            replicas = [(s.kind, s.pages, s.nbytes, s.checksum) for s in group]
            confirmed |= {s.hash for s, match in zip(group, self._verify(url, replicas)) if match is False}
        if len(confirmed) < len(reported):
            log.warning("%d of %d blocks a reader reported bad were not confirmed by their workers; kept",
                        len(reported) - len(confirmed), len(reported))
        return confirmed

    def flush_accesses(self, rows: int | None = STATS_ROWS_PER_FLUSH) -> int:
        """What loads read since the last flush, off the request path: the hits go to the tier
        policies now (deepest block of a load first, so a prefix stays more recent than its
        suffixes); counts and times join the statistics waiting for SQL, of which one job writes at
        most `rows` rows (the oldest first; None: all of them, as at shut-down). Under a heavy load
        the SQL copy lags; it only orders the policies after a restart. Returns the distinct blocks
        read."""
        counts, entries = self._index.drain_accesses()
        now = self._clock()
        hits = []
        for entry in entries.values():
            best = self._index.best(entry)
            if best is not None:  # still readable
                tier_id = best[1].id
                hits.append(([tier_id] + [r.tier_id for r in entry.replicas if r.tier_id != tier_id], entry.block_id,
                             block_key(entry.namespace_id, entry.hash)))
        for start in range(0, len(hits), POLICY_HITS_AT_ONCE):  # the writer's admissions wait between
            self._policies.hit_many(hits[start : start + POLICY_HITS_AT_ONCE])
        pending = self._pending_stats
        for block_id, n in counts.items():
            pending[block_id] = (now, pending.pop(block_id, (0.0, 0))[1] + n)
        if pending:
            batch = {}
            for block_id in list(itertools.islice(pending, rows)):
                batch[block_id] = pending.pop(block_id)
            self._write(lambda tx: repo.record_hits(tx.session, batch))
        return len(counts)


def hit_body(hit: Hit) -> dict:
    return {"hash": hit.hash, "nbytes": hit.nbytes, "checksum": hit.checksum,
            "location": views.location(hit.worker, hit.tier, hit.runs(), hit.nbytes)}


def by_tier(hits: list[Hit]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for hit in hits:
        counts[hit.tier.kind] = counts.get(hit.tier.kind, 0) + 1
    return counts


def _readable_prefix(hits: list[Hit]) -> list[Hit]:
    """The leading hits a connector can read itself (a block left on NVMe or S3 ends the prefix)."""
    for i, hit in enumerate(hits):
        if hit.tier.kind not in tiers.ENGINE_READABLE:
            return hits[:i]
    return hits


def _pinned_prefix(hits: list[Hit], pinned: set[int]) -> list[Hit]:
    """A replica that stopped being readable since the index was read ends the prefix."""
    for i, hit in enumerate(hits):
        if hit.replica_id not in pinned:
            return hits[:i]
    return hits
