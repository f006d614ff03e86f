"""The session-aware LRU and the hinted admission, story by story: classes that are read again
rarely go first, tails included, whatever the hints say of themselves; wrong hints cost nothing."""

from __future__ import annotations

import itertools
import random

from kvstore.policies import Admit, HintedAdmission, Hints, SessionLRU
from kvstore.policies.classes import SAMPLE, ReuseClasses, sampled
from kvstore.policies.tinylfu import key_hash

NONE, TURN = Hints(retain="none"), Hints(retain="turn")


def run(policy: SessionLRU, capacity: int, requests) -> int:
    """Replay (keys, hints) requests as a tier does; the hits."""
    hits = 0
    for keys, hints in requests:
        for key in keys:
            if key in policy:
                policy.touch(key)
                hits += 1
            else:
                while len(policy) >= capacity:
                    policy.evict(1, set(keys))
                policy.insert(key, None, hints)
    return hits


def sessions(n: int, said: dict[bool, Hints], seed: int = 0):
    """Two-turn conversations: half come back 10 to 200 requests later (the second turn reads the
    first's two blocks), half never do; `said` is what each first turn says, by whether it comes
    back."""
    rng, keys, back_at = random.Random(seed), itertools.count(), {}
    for i in range(n):
        back = rng.random() < 0.5
        blocks = [next(keys), next(keys)]
        yield blocks, said[back]
        if back:
            back_at.setdefault(i + rng.randint(10, 200), []).append(blocks)
        for returning in back_at.pop(i, []):
            yield returning, Hints()


PLAIN = {True: Hints(), False: Hints()}


def test_blocks_of_a_class_that_is_never_read_again_are_evicted_first():
    # up to 400 blocks are saved before a conversation comes back: more than a 200-block tier
    # holds, unless it keeps only the conversations that come back
    informed, plain = SessionLRU(200), SessionLRU(200)
    told = run(informed, 200, sessions(20_000, {True: TURN, False: NONE}))
    untold = run(plain, 200, sessions(20_000, PLAIN))
    assert told > 1.5 * untold, (told, untold)
    assert informed.classes.level(NONE.signature) >= 2 and informed.classes.level(TURN.signature) == 0


def test_hints_that_say_nothing_true_change_nothing():
    rng = random.Random(3)
    noise = ((keys, rng.choice([TURN, NONE]) if hints is not PLAIN[True] else hints)
             for keys, hints in sessions(20_000, {True: Hints(session="a"), False: Hints(session="b")}))
    misled, plain = SessionLRU(200), SessionLRU(200)
    told, untold = run(misled, 200, noise), run(plain, 200, sessions(20_000, PLAIN))
    assert abs(told - untold) < 0.05 * max(1, untold), (told, untold)  # within noise of no hints
    assert misled.classes.level(NONE.signature) == misled.classes.level(TURN.signature) == 0


def test_a_tail_that_a_later_save_extends_joins_its_class():
    policy = SessionLRU(64)
    for i in range(200 * SAMPLE):  # tails never read again, other blocks read: the tails' class sinks
        while len(policy) >= 32:
            policy.evict(1)
        policy.insert(("t", i), None, Hints(tail=True))
        policy.insert(("b", i), None, Hints())
        policy.touch(("b", i))
    assert policy.classes.level(Hints(tail=True).signature) >= 2
    policy.evict(len(policy))
    assert not any(sampled(key_hash(k)) for k in ("c0", "c1", "c2", "b0", "b1"))  # none measures its class
    policy.insert("c0", None, Hints())
    policy.insert("c1", "c0", Hints(tail=True))  # a save's tail: low
    policy.insert("b0", None, Hints())
    policy.insert("b1", "b0", Hints(tail=True))
    policy.insert("c2", "c1", Hints(tail=True))  # the next turn extends c1: a tail no more
    # a tail goes once its age times 2^level passes the oldest other block's: b1 (1 x >= 4) before
    # c0 (4), c2 (0 x >= 4) only after b0 (2); c1, a tail of age 3 had it stayed one, goes last
    assert policy.order(5) == ["b1", "c0", "b0", "c2", "c1"]
    assert policy.evict(2) == ["b1", "c0"] and policy.evict(3) == ["b0", "c2", "c1"]


def test_reuse_classes_learn_from_their_sample_and_follow_the_workload():
    classes = ReuseClasses()
    for i in range(400):
        classes.inserted(("good", i), TURN.signature)
        classes.hit(("good", i))
        classes.inserted(("bad", i), NONE.signature)
        classes.gone(("bad", i))
    assert classes.level(TURN.signature) == 0 and classes.level(NONE.signature) == 4
    assert classes.better(TURN.signature) and not classes.better(NONE.signature)
    assert classes.level(Hints(priority=1).signature) == 0  # no evidence: kept as the best


def test_the_hinted_admission_lets_a_known_continuation_skip_the_doorkeeper():
    admission, cache = HintedAdmission(256), set()
    scan, turns = itertools.count(), itertools.count()
    waiting: list = []
    for _ in range(200):  # a hot set, one-off blocks that flush it (the doorkeeper filters), and
        for key in [("hot", i) for i in range(100)] + [("scan", next(scan)) for _ in range(200)]:
            if key in cache:  # conversations whose next turn reads their blocks a round later
                admission.record(key)
            elif admission.admit(key, 0, NONE if key[0] == "scan" else None) == Admit():
                cache.add(key)
        for key in waiting:
            admission.record(key)
        waiting = [("turn", next(turns)) for _ in range(20)]
        for key in waiting:
            admission.admit(key, 0, TURN)
    assert admission.doorkeeper.filtering and admission.classes.better(TURN.signature)
    fresh = [("new", i) for i in range(100) if not sampled(key_hash(("new", i)))][:3]
    assert admission.admit(fresh[0], 0, TURN) == Admit()  # at its first sighting
    assert admission.admit(fresh[1], 0, NONE) != Admit()
    assert admission.admit(fresh[2], 0, None) != Admit()
