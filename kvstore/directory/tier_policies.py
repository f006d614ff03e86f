"""The directory's eviction and admission: one pair of policy objects (kvstore/policies) per tier.

    policies.admit(tier, key, nbytes)     # placement of a new block, and "keep it one tier down?"
    policies.admit_many(tier, [(key, nbytes, hints)])   # the same for a save's blocks, with its hints
    policies.expect(tier, [(key, hints)]) # a save reserved these: its hints reach the policy at commit
    policies.hit_many([(tier ids, key)])  # loads read them: touch + record
    policies.build(tier, read_rows)       # the first time: from the tier's READY replicas, off every path
    policies.victims(tier, rows, ...)     # sync with the tier's READY replicas, then evict
    policies.changed([(key, parent, added, removed)])   # the index saw blocks' replicas come or go
    policies.evict(tier, n, keep) -> keys | None    # victims without a sync: O(victims)

SQL stays the truth of what is where; the policy objects are the directory's memory of recency
and frequency. Before choosing victims, a tier's eviction policy is brought to the tier's READY
replicas (rows that went are removed, new ones inserted oldest first), so nothing the database
does not hold is ever named and nothing it holds is forgotten. The first sync after a start
rebuilds the policy from `last_access` (and replays `hit_count` into the admission's counts).
Keys are `namespace_id/hash` strings.

The full sync runs once per tier (the first time it needs victims, which after a
start rebuilds it); from then on the lookup index reports every replica that
becomes readable or goes (`changed`), so choosing victims costs what the victims
cost, not what the tier holds. A key the policy names that the tier no longer
holds is dropped by the caller, and a policy that runs dry is synced again.
`build` makes that first sync a new policy filled without the lock, from rows
read off the writer: at a million blocks it takes about 20 s, and as a writer
job it held every save's commit that long (and every admission, behind the
lock). Changes reported while it runs are kept and replayed before it takes over.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.core import heap
from kvstore.policies import Backpressure, make_admission, make_eviction
from kvstore.policies.admission import AdmissionChain, Decision
from kvstore.policies.hints import NONE as NO_HINTS
from kvstore.policies.hints import Hints

UNBOUNDED_BLOCKS = 1 << 20  # the size policies assume for a tier without a capacity (S3)
REPLAY_HITS = 3  # at most this many recorded hits per block when rebuilding admission counts
REPLAY_AT_ONCE = 10_000  # what a build replays under one hold of the lock (hits of blocks, reported changes)
MAX_EXPECTED = 1 << 20  # hints of reserved blocks kept for their commit; the oldest are dropped first


def block_key(namespace_id: str, block_hash: str) -> str:
    return f"{namespace_id}/{block_hash}"


@dataclass
class VictimRow:
    """One READY replica of the tier, as `victims` needs it."""
    key: str
    parent: str | None
    last_access: float
    depth: int
    hit_count: int
    nbytes: int
    pinned: bool
    row: object  # what the caller gets back for a victim


@dataclass
class _TierPolicy:
    eviction: object
    admission: object
    built: bool = False
    pressure: list = field(default_factory=list)  # Backpressure conditions to update
    blocks: int = 1  # the capacity its policies were made for
    pending: list | None = None  # while `build` runs: (key, parent, added here?) reported meanwhile
    building: threading.Lock = field(default_factory=threading.Lock)


def _locked(method):
    def call(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class TierPolicies:
    """Used by the writer thread (admission, victims, changes the index reports) and by the reaper
    (hits, in chunks): every call holds `lock`, briefly."""

    def __init__(self, eviction: dict[str, str], admission: dict[str, str]) -> None:
        self._names = eviction, admission  # by tier kind
        self._tiers: dict[int, _TierPolicy] = {}
        self._expected: OrderedDict[tuple[int, str], Hints] = OrderedDict()  # (tier id, key) -> its save's hints
        self.lock = threading.RLock()

    def _of(self, tier) -> _TierPolicy:
        if tier.id not in self._tiers:
            blocks = tier.capacity_bytes // tier.page_bytes if tier.capacity_bytes else UNBOUNDED_BLOCKS
            admission = make_admission(self._names[1][tier.kind], max(1, blocks))
            conditions = admission.conditions if isinstance(admission, AdmissionChain) else [admission]
            self._tiers[tier.id] = _TierPolicy(make_eviction(self._names[0][tier.kind], max(1, blocks)), admission,
                                               pressure=[c for c in conditions if isinstance(c, Backpressure)],
                                               blocks=max(1, blocks))
            heap.freeze()  # its sets grow to a key per block
        return self._tiers[tier.id]

    @_locked
    def forget(self, tier_id: int) -> None:
        """The tier went away (its worker re-registered with new tiers)."""
        self._tiers.pop(tier_id, None)

    def admit(self, tier, key: str, nbytes: int, hints: Hints | None = None) -> Decision:
        return self.admit_many(tier, [(key, nbytes, hints)])[0]

    @_locked
    def admit_many(self, tier, requests: list[tuple[str, int, Hints | None]]) -> list[Decision]:
        """`admit` for (key, nbytes, hints) in turn, under one hold of the lock."""
        policy = self._of(tier)
        for condition in policy.pressure:
            condition.pressure = tier.used_bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0
        admit = policy.admission.admit
        return [admit(key, nbytes, hints) for key, nbytes, hints in requests]

    @_locked
    def expect(self, tier, blocks: list[tuple[str, Hints | None]]) -> None:
        """A save reserved these blocks on `tier`: when they become readable there, the tier's
        eviction policy gets them with these hints. Hints that say nothing are not kept (a policy
        takes None for them)."""
        for key, hints in blocks:
            if hints is not None and hints != NO_HINTS:
                self._expected[(tier.id, key)] = hints
        while len(self._expected) > MAX_EXPECTED:
            self._expected.popitem(last=False)

    @_locked
    def hit_many(self, hits: list[tuple[list[int], str]]) -> None:
        """Loads read these keys: (the ids of the tiers that hold it, the one that served it first;
        key). Each holding tier's eviction policy is touched, the serving tier's admission records
        the key. Tiers without a policy yet are skipped; one hold of the lock for all."""
        policies = self._tiers
        for tier_ids, key in hits:
            for i, tier_id in enumerate(tier_ids):
                policy = policies.get(tier_id)
                if policy is None:
                    continue
                if key in policy.eviction:
                    policy.eviction.touch(key)
                if i == 0:
                    policy.admission.record(key)

    @_locked
    def built(self, tier) -> bool:
        return self._of(tier).built

    @_locked
    def changed(self, changes: list[tuple[str, str | None, list[int], list[int]]]) -> None:
        """(key, parent, added, removed): replicas of `key` became readable on the tiers `added` and
        left `removed` (tier ids). Tiers whose policy is not built yet learn it at their first sync;
        a build under way keeps them to replay."""
        built = {tier_id: p for tier_id, p in self._tiers.items() if p.built}
        building = {tier_id: p.pending for tier_id, p in self._tiers.items() if p.pending is not None}
        expected = self._expected
        for key, parent, added, removed in changes:
            for tier_id in removed:
                policy = built.get(tier_id)
                if policy is not None:
                    policy.eviction.remove(key)
                elif tier_id in building:
                    building[tier_id].append((key, parent, False))
            for tier_id in added:
                policy = built.get(tier_id)
                if policy is not None and key not in policy.eviction:
                    policy.eviction.insert(key, parent, expected.pop((tier_id, key), None))
                elif tier_id in building:
                    building[tier_id].append((key, parent, True))

    def build(self, tier, read_rows: Callable[[], list[tuple[str, str, str | None, int]]]) -> None:
        """The tier's eviction policy from its READY replicas, unless it is built: `read_rows` (called
        without the lock) gives (namespace id, hash, parent hash, hit count) oldest first, as plain
        tuples, which the garbage collector stops walking (objects per row made each of its full
        collections during a build a pause of most of a second). A new policy is filled outside
        the lock, the admission's counts are replayed in chunks under it, the changes reported
        meanwhile replayed, and then it takes over. A second caller waits for the first's build."""
        with self.lock:
            policy = self._of(tier)
        with policy.building:
            with self.lock:
                if policy.built:
                    return
                policy.pending = []
                hints = {key: h for (tier_id, key), h in self._expected.items() if tier_id == tier.id}
            try:
                rows = read_rows()
                fresh = make_eviction(self._names[0][tier.kind], policy.blocks)
                for start in range(0, len(rows), REPLAY_AT_ONCE):
                    keys = []
                    for namespace_id, block_hash, parent, hits in rows[start : start + REPLAY_AT_ONCE]:
                        key = block_key(namespace_id, block_hash)
                        fresh.insert(key, block_key(namespace_id, parent) if parent else None, hints.get(key))
                        keys.append((key, min(hits, REPLAY_HITS)))
                    with self.lock:  # the admission's counts, as _sync replays them
                        for key, hits in keys:
                            for _ in range(hits):
                                policy.admission.record(key)
                replayed = 0
                while True:  # what was reported meanwhile: outside the lock while there is much of it
                    with self.lock:
                        batch = policy.pending[replayed:]
                        said = {key: self._expected.get((tier.id, key)) for key, _, added in batch if added}
                        if len(batch) <= REPLAY_AT_ONCE:
                            _replay(fresh, batch, said)
                            for key in hints.keys() | {key for key, _, added in policy.pending if added}:
                                if key in fresh:
                                    self._expected.pop((tier.id, key), None)
                            # in the same hold as the replay: a change reported after it goes to the new policy
                            policy.eviction, policy.built, policy.pending = fresh, True, None
                            break
                    _replay(fresh, batch, said)
                    replayed += len(batch)
                del rows, fresh  # before the collection below
            finally:
                with self.lock:
                    policy.pending = None  # a build that failed keeps nothing
        heap.freeze()  # the new policy's containers, as _of froze the first one's

    @_locked
    def evict(self, tier, n: int, keep: set[str]) -> list[str] | None:
        """Up to `n` victims from the tier's policy as it stands (no sync); None when it is empty."""
        policy = self._of(tier)
        victims = policy.eviction.evict(min(n, max(1, len(policy.eviction) - len(keep))), keep)
        if victims is None and n > 1:
            victims = policy.eviction.evict(1, keep)
        return victims

    @_locked
    def unbuild(self, tier) -> None:
        """The next victims() syncs from the rows again (the policy ran dry while the tier is full)."""
        self._of(tier).built = False

    def victims(self, tier, rows: list[VictimRow], protected: set[str], to_free: int, limit: int,
                dry_run: bool = False) -> list:
        """Sync the tier's eviction policy with `rows` (its READY replicas), then evict until
        `to_free` bytes or `limit` rows. Pinned rows and `protected` keys stay. A dry run asks a
        copy, synced and asked outside the lock (only the copy holds it), so it changes nothing and
        admissions do not wait for it."""
        if dry_run:
            with self.lock:  # the eviction order only; its admission is not the dry run's to feed
                live = self._of(tier)
                policy = _TierPolicy(copy.deepcopy(live.eviction), _Unrecorded(), live.built)
            self._sync(tier.id, policy, rows, expected={})
            return _choose(policy.eviction, rows, protected, to_free, limit)
        with self.lock:
            policy = self._of(tier)
            self._sync(tier.id, policy, rows)
            return _choose(policy.eviction, rows, protected, to_free, limit)

    def _sync(self, tier_id: int, policy: _TierPolicy, rows: list[VictimRow], expected: dict | None = None) -> None:
        expected = self._expected if expected is None else expected  # a copy's sync takes no hints
        present = {r.key for r in rows}
        for key in [k for k in policy.eviction if k not in present]:
            policy.eviction.remove(key)
        # oldest first; on ties the deeper block first, so a prefix is more recent than its suffix
        for r in sorted((r for r in rows if r.key not in policy.eviction), key=lambda r: (r.last_access, -r.depth)):
            policy.eviction.insert(r.key, r.parent, expected.pop((tier_id, r.key), None))
            if not policy.built:
                for _ in range(min(r.hit_count, REPLAY_HITS)):
                    policy.admission.record(r.key)
        policy.built = True


def _replay(eviction, changes: list[tuple[str, str | None, bool]], hints: dict) -> None:
    """Changes reported while a policy was built, in their order: (key, parent, added?)."""
    for key, parent, added in changes:
        if not added:
            eviction.remove(key)
        elif key not in eviction:
            eviction.insert(key, parent, hints.get(key))


def _choose(eviction, rows: list[VictimRow], protected: set[str], to_free: int, limit: int) -> list:
    """Victims from `eviction` until `to_free` bytes or `limit` rows; pinned and protected keys stay."""
    by_key = {r.key: r for r in rows}
    keep = protected | {r.key for r in rows if r.pinned}
    chosen, freed = [], 0
    while freed < to_free and len(chosen) < limit:
        victims = eviction.evict(1, keep)
        if victims is None:
            break
        chosen.append(by_key[victims[0]].row)
        freed += by_key[victims[0]].nbytes
    return chosen


class _Unrecorded:
    """An admission that forgets what it is told (a dry run's copy of a policy)."""

    def record(self, key: str) -> None:
        pass
