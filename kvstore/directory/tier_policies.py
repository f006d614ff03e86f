"""The directory's eviction and admission: one pair of policy objects (kvstore/policies) per tier.

    policies.admit(tier, key, nbytes)     # placement of a new block, and "keep it one tier down?"
    policies.admit_many(tier, [(key, nbytes, hints)])   # the same for a save's blocks, with its hints
    policies.expect(tier, [(namespace, hash, hints)])   # a save reserved these: hints reach the policy
    policies.hit_many([(tier ids, block id, key)])      # loads read them: touch + record
    policies.build(tier, read_rows)       # the first time: from the tier's READY replicas, off every path
    policies.victims(tier, rows, ...)     # sync with the tier's READY replicas, then evict
    policies.changed([(block id, parent id, namespace, hash, added, removed)])  # the index saw replicas
    policies.evict(tier, n, keep) -> block ids | None   # victims without a sync: O(victims)
    policies.peek(tier, n, keep) -> block ids | None    # what evict would name, nothing changed (a dry run)

SQL stays the truth of what is where; the policy objects are the directory's memory of recency
and frequency. Before choosing victims, a tier's eviction policy is brought to the tier's READY
replicas (rows that went are removed, new ones inserted oldest first), so nothing the database
does not hold is ever named and nothing it holds is forgotten. The first sync after a start
rebuilds the policy from `last_access` (and replays `hit_count` into the admission's counts).

An eviction policy's keys are block ids (and a parent its block's id): an int the lookup index
holds anyway, where a `namespace/hash` string per block cost 112 bytes more at a million blocks,
and victims come back as the ids SQL names rows by. An admission's keys are `namespace/hash`
strings (`block_key`): it decides before a block has an id, and remembers a rejected block that
never gets one; it keeps hashes and small samples of them, not a key per block.

The full sync runs once per tier (the first time it needs victims, which after a
start rebuilds it); from then on the lookup index reports every replica that
becomes readable or goes (`changed`), so choosing victims costs what the victims
cost, not what the tier holds. A key the policy names that the tier no longer
holds is dropped by the caller, and a policy that runs dry is synced again.
`build` makes that first sync a new policy filled without the lock, from rows
read off the writer: at a million blocks it took about 20 s as a writer job,
which held every save's commit that long (and every admission, behind the
lock); read in chunks it takes 4-10 s beside them. Changes reported while it
runs are kept and replayed before it takes over.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.core import heap
from kvstore.core.pace import paced
from kvstore.policies import Backpressure, make_admission, make_eviction
from kvstore.policies.admission import AdmissionChain, Decision
from kvstore.policies.hints import NONE as NO_HINTS
from kvstore.policies.hints import Hints

UNBOUNDED_BLOCKS = 1 << 20  # the size policies assume for a tier without a capacity (S3)
REPLAY_HITS = 3  # at most this many recorded hits per block when rebuilding admission counts
REPLAY_AT_ONCE = 10_000  # changes reported during a build that it replays under one hold of the lock
MAX_EXPECTED = 1 << 20  # hints of reserved blocks kept for their commit; the oldest are dropped first
_TIER_ID, _BLOCK_ID = 0, 1  # of an expected hint's key once its block is committed


class Unanswered(Exception):
    """The tier's order cannot say now (it lives elsewhere and did not answer): take SQL's order."""


def block_key(namespace_id: str, block_hash: str) -> str:
    return f"{namespace_id}/{block_hash}"


@dataclass
class VictimRow:
    """One READY replica of the tier, as `victims` needs it."""
    key: int  # its block's id
    parent: int | None  # its parent block's id
    last_access: float
    depth: int
    hit_count: int
    nbytes: int
    pinned: bool
    row: object  # what the caller gets back for a victim
    name: str = ""  # `namespace/hash`, the admission's key: where hit_count is not 0


@dataclass
class _TierPolicy:
    eviction: object
    admission: object
    built: bool = False
    pressure: list = field(default_factory=list)  # Backpressure conditions to update
    blocks: int = 1  # the capacity its policies were made for
    pending: list | None = None  # while `build` runs: (block id, parent id, added here?) reported meanwhile
    building: threading.Lock = field(default_factory=threading.Lock)


def _locked(method):
    def call(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class TierPolicies:
    """Used by the writer thread (admission, victims, changes the index reports) and by the reaper
    (hits, in chunks): every call holds `lock`, briefly. The eviction orders live in this process
    (`local`): a caller may sync one from the tier's rows (`victims`). `moves/order.py` keeps them in
    a child process instead."""

    local = True

    def __init__(self, eviction: dict[str, str], admission: dict[str, str]) -> None:
        self._names = eviction, admission  # by tier kind
        self._tiers: dict[int, _TierPolicy] = {}
        # a save's hints by (tier id, namespace, hash) while it is reserved, by (tier id, block id) once it
        # committed on a tier whose policy is not built yet
        self._expected: OrderedDict[tuple, Hints] = OrderedDict()
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
        return [admit(key, nbytes, hints) for key, nbytes, hints in paced(requests)]

    @_locked
    def expect(self, tier, blocks: list[tuple[str, str, Hints | None]]) -> None:
        """A save reserved these blocks (namespace, hash, hints) on `tier`: when they become readable
        there, the tier's eviction policy gets them with these hints. Hints that say nothing are not
        kept (a policy takes None for them)."""
        for namespace_id, block_hash, hints in blocks:
            if hints is not None and hints != NO_HINTS:
                self._expected[(tier.id, namespace_id, block_hash)] = hints
        self._trim_expected()

    def _trim_expected(self) -> None:
        while len(self._expected) > MAX_EXPECTED:
            self._expected.popitem(last=False)

    @_locked
    def hit_many(self, hits: list[tuple[list[int], int, str]]) -> None:
        """Loads read these blocks: (the ids of the tiers that hold it, the one that served it first;
        block id; key). Each holding tier's eviction policy is touched, the serving tier's admission
        records the key. Tiers without a policy yet are skipped; one hold of the lock for all."""
        policies = self._tiers
        for tier_ids, block_id, key in hits:
            for i, tier_id in enumerate(tier_ids):
                policy = policies.get(tier_id)
                if policy is None:
                    continue
                if block_id in policy.eviction:
                    policy.eviction.touch(block_id)
                if i == 0:
                    policy.admission.record(key)

    @_locked
    def built(self, tier) -> bool:
        return self._of(tier).built

    @_locked
    def expected(self) -> list[tuple[tuple, Hints]]:
        """The hints of saves not yet taken by a tier's policy, oldest first: (tier id, namespace,
        hash) before the commit, (tier id, block id) after it."""
        return list(self._expected.items())

    @_locked
    def take_expected(self) -> list[tuple[tuple, Hints]]:
        """`expected()`, forgotten here: another holder of the orders takes them (`keep_expected`)."""
        items = list(self._expected.items())
        self._expected.clear()
        return items

    @_locked
    def keep_expected(self, items: list[tuple[tuple, Hints]]) -> None:
        """Hints that another holder kept until now, as `expected()` lists them."""
        self._expected.update(items)
        self._trim_expected()

    @_locked
    def eviction_of(self, tier):
        """The tier's eviction policy (as built so far)."""
        return self._of(tier).eviction

    @_locked
    def changed(self, changes: list[tuple[int, int | None, str, str, list[int], list[int]]]) -> None:
        """(block id, parent block id, namespace, hash, added, removed): replicas of the block became
        readable on the tiers `added` and left `removed` (tier ids). Tiers whose policy is not built
        yet learn it at their first sync (a save's hints wait for it under the block's id); a build
        under way keeps them to replay."""
        built = {tier_id: p for tier_id, p in self._tiers.items() if p.built}
        building = {tier_id: p.pending for tier_id, p in self._tiers.items() if p.pending is not None}
        expected = self._expected
        for block_id, parent, namespace_id, block_hash, added, removed in changes:
            for tier_id in removed:
                policy = built.get(tier_id)
                if policy is not None:
                    policy.eviction.remove(block_id)
                elif tier_id in building:
                    building[tier_id].append((block_id, parent, False))
            for tier_id in added:
                hints = expected.pop((tier_id, namespace_id, block_hash), None) if expected else None
                policy = built.get(tier_id)
                if policy is not None:
                    if block_id not in policy.eviction:
                        policy.eviction.insert(block_id, parent, hints)
                    continue
                if tier_id in building:
                    building[tier_id].append((block_id, parent, True))
                if hints is not None:
                    expected[(tier_id, block_id)] = hints
        self._trim_expected()

    def build(self, tier, read_rows: Callable[[Callable[[list[tuple]], None]], None]) -> None:
        """The tier's eviction policy from its READY replicas, unless it is built. `read_rows(fill)`
        (called without the lock) hands `fill` the rows in chunks, oldest first: (block id, parent
        block id, hit count, namespace id, hash), the namespace and hash only where the hit count is
        not 0 (the admission's keys). In chunks, the rows of one reuse the memory of the last: a
        million read at once left 100-150 MiB of freed memory the process could not give back,
        pinned by the policy's keys allocated between them. A new policy is filled outside the
        lock, the admission's counts are replayed per chunk under it, the changes reported meanwhile
        replayed, and then it takes over. A second caller waits for the first's build."""
        with self.lock:
            policy = self._of(tier)
        with policy.building:
            with self.lock:
                if policy.built:
                    return
                policy.pending = []
                hints = {key[_BLOCK_ID]: h for key, h in self._expected.items()
                         if len(key) == 2 and key[_TIER_ID] == tier.id}
            try:
                fresh = make_eviction(self._names[0][tier.kind], policy.blocks)

                def fill(rows: list[tuple]) -> None:
                    keys = []
                    for block_id, parent, hits, namespace_id, block_hash in paced(rows):
                        fresh.insert(block_id, parent, hints.get(block_id))
                        if hits:
                            keys.append((block_key(namespace_id, block_hash), hits))
                    with self.lock:  # the admission's counts, as _sync replays them
                        for key, hits in keys:
                            record_hits(policy.admission, key, hits)
                read_rows(fill)
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
                del fresh, fill  # before the collection below
            finally:
                with self.lock:
                    policy.pending = None  # a build that failed keeps nothing
        heap.freeze()  # the new policy's containers, as _of froze the first one's
        heap.give_back()  # what the rows and the policy's growth freed

    @_locked
    def evict(self, tier, n: int, keep: set[int]) -> list[int] | None:
        """Up to `n` victims from the tier's policy as it stands (no sync); None when it is empty.
        (An order that lives elsewhere may raise Unanswered; this one always answers.)"""
        policy = self._of(tier)
        victims = policy.eviction.evict(min(n, max(1, len(policy.eviction) - len(keep))), keep)
        if victims is None and n > 1:
            victims = policy.eviction.evict(1, keep)
        return victims

    @_locked
    def peek(self, tier, n: int, keep: set[int]) -> list[int] | None:
        """The `n` blocks the tier's policy would evict next, leaving it as it is (a dry run): O(n)
        under the lock. None when it is not built, or is a policy that cannot tell without evicting
        (no `order`): the caller then asks `victims` for a dry run on a copy."""
        policy = self._of(tier)
        order = getattr(policy.eviction, "order", None)
        return order(n, keep) if policy.built and order is not None else None

    def dry_run(self, tier, limit: int, keep: set[int], to_free: int) -> tuple[int, int] | None:
        """(replicas, bytes) a dry run would name, where the order is elsewhere; None here: the caller
        asks `peek`, or `victims` on a copy."""
        return None

    def close(self) -> None:
        """Nothing to stop: the orders are this process's memory."""

    @_locked
    def unbuild(self, tier) -> None:
        """The next victims() syncs from the rows again (the policy ran dry while the tier is full)."""
        self._of(tier).built = False

    def victims(self, tier, rows: list[VictimRow], protected: set[int], to_free: int, limit: int,
                dry_run: bool = False) -> list:
        """Sync the tier's eviction policy with `rows` (its READY replicas), then evict until
        `to_free` bytes or `limit` rows. Pinned rows and `protected` blocks (ids) stay. A dry run asks a
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
        present = {r.key for r in paced(rows)}
        for key in [k for k in paced(policy.eviction) if k not in present]:
            policy.eviction.remove(key)
        # oldest first; on ties the deeper block first, so a prefix is more recent than its suffix
        new = sorted((r for r in paced(rows) if r.key not in policy.eviction), key=lambda r: (r.last_access, -r.depth))
        for r in paced(new):
            policy.eviction.insert(r.key, r.parent, expected.pop((tier_id, r.key), None))
            if not policy.built:
                record_hits(policy.admission, r.name, r.hit_count)
        policy.built = True


def record_hits(admission, key: str, hits: int) -> None:
    """A block's recorded hits, replayed into a rebuilt admission (at most REPLAY_HITS)."""
    for _ in range(min(hits, REPLAY_HITS)):
        admission.record(key)


def _replay(eviction, changes: list[tuple[int, int | None, bool]], hints: dict) -> None:
    """Changes reported while a policy was built, in their order: (block id, parent id, added?)."""
    for key, parent, added in changes:
        if not added:
            eviction.remove(key)
        elif key not in eviction:
            eviction.insert(key, parent, hints.get(key))


def _choose(eviction, rows: list[VictimRow], protected: set[int], to_free: int, limit: int) -> list:
    """Victims from `eviction` until `to_free` bytes or `limit` rows; pinned and protected blocks stay."""
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
