"""Session-aware LRU: blocks of classes that are read again rarely go first, blocks read twice last.

    insert(key, parent, hints)   # into the segment of its class's level (hints.signature)
    touch(key)                   # read: to level 0's MRU end; read twice: into the hot segment
    evict(n, protected)          # of the levels' oldest blocks, the one whose age times 2^level is
                                 # the largest; the hot segment last

Levels come from `classes.ReuseClasses`: a class read about 2^k times less than the best one goes
to level k, and a block of level k is worth keeping about as long as a level-0 block 2^k times older
(age: inserts and reads since it entered its segment, a logical clock). A strict order, every
level-k block before any of level 0, fills a large tier with level-0 blocks that are never read
again (a save's blocks of ended conversations) while the young blocks of a worse class, read again
soon, are the first to go. What the engine says (`retain`, `priority`) and what the store sees (a save's last
block, its `tail`) make the classes; with no hints there are two (tails and the rest), with random
hints all classes are read alike and the policy is LRU with a hot segment. A tail that a later
save extends (it names it as a parent: the next turn of a conversation, the next chunk of a
prompt) joins its class without the tail.

The hot segment (blocks read at least twice after they were stored) helps where popularity
repeats (documents behind many questions) and hurts where it does not (a conversation's blocks are
read once per turn): its size follows whichever of two small shadow caches on a sample of the
keys, plain LRU or LRU with a hot half that promotes as this policy does, is hitting more (set
dueling), at HOT_SHARE of the blocks or nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice

from kvstore.policies.classes import MAX_LEVEL, ReuseClasses, sampled
from kvstore.policies.hints import Hints, signature
from kvstore.policies.shadows import Shadow, shadow_rate
from kvstore.policies.tinylfu import key_hash

HOT_SHARE = 0.5
HOT = MAX_LEVEL + 1  # the hot segment's index, after the levels'
SEGMENT = 15  # a key's state: its segment's index, and these flags
READ, SHADOWED, SAMPLED, TAIL = 16, 32, 64, 128  # read once; feeds the shadows; measures its class; a tail


class SessionLRU:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "a session-aware LRU needs a capacity"
        self._segments: list[OrderedDict] = [OrderedDict() for _ in range(HOT + 1)]
        self._levels, self._hot = self._segments[:HOT], self._segments[HOT]
        self._clock = 0  # logical: inserts and reads; a segment maps its keys to when they entered it
        self._state: dict[Hashable, int] = {}
        self._tails: dict[Hashable, tuple] = {}  # key saved as a tail -> its class without the tail
        self.classes = ReuseClasses()
        rate = shadow_rate(capacity)
        self._cut = int(rate * (1 << 64))  # keys hashed below it feed the shadows
        size = max(1, round(capacity * rate))
        self._shadows = (Shadow(size, 0.0), Shadow(size, HOT_SHARE))
        self._decay_every, self._seen = 4 * size, 0
        self.hot_share = 0.0

    # ---- the contract --------------------------------------------------------------------

    def insert(self, key: Hashable, parent: Hashable | None = None, hints: Hints | None = None) -> None:
        assert key not in self._state, "insert of a present key"
        h = key_hash(key)
        sig = signature(hints)
        flags = 0
        if h < self._cut:
            flags |= SHADOWED
            self._observe(key)
        if sampled(h):  # measured as if its class were the best
            flags |= SAMPLED
            self.classes.inserted(key, sig)
            level = 0
        else:
            level = self.classes.level(sig)
        if sig[1]:  # a tail: its class without the tail, for when a later save extends it
            flags |= TAIL
            self._tails[key] = (sig[0], False, sig[2])
        self._clock += 1
        self._levels[level][key] = self._clock
        self._state[key] = level | flags
        if parent is not None and self._state.get(parent, 0) & TAIL:
            self._untail(parent)

    def touch(self, key: Hashable) -> None:
        state = self._state[key]
        if state & SAMPLED:
            self.classes.hit(key)
            state &= ~SAMPLED
        if state & TAIL:
            del self._tails[key]
            state &= ~TAIL
        index = state & SEGMENT
        self._clock += 1
        if index == HOT:
            self._hot[key] = self._clock
            self._hot.move_to_end(key)
        elif state & READ and self.hot_share > 0:  # read twice: hot
            del self._segments[index][key]
            self._hot[key] = self._clock
            state = (state & ~(SEGMENT | READ)) | HOT
        elif index == 0:
            self._levels[0][key] = self._clock
            self._levels[0].move_to_end(key)
            state |= READ
        else:
            del self._segments[index][key]
            self._levels[0][key] = self._clock
            state = (state & ~SEGMENT) | READ
        self._state[key] = state
        if state & SEGMENT == HOT and index != HOT:
            self._fit_hot()
        if state & SHADOWED:  # last: the shadows may resize the hot segment, this key's included
            self._observe(key)

    def evict(self, n: int, protected=()) -> list | None:
        protected = protected if isinstance(protected, (set, frozenset, dict)) else set(protected)
        victims = list(islice(self._victims(protected), n))
        if len(victims) < n:
            return None
        for key in victims:
            self._drop(key)
        return victims

    def remove(self, key: Hashable) -> None:
        if key in self._state:
            self._drop(key)

    def order(self, n: int, protected=()) -> list:
        """The keys `evict(n, protected)` would name, in its order (fewer when it holds fewer)."""
        protected = protected if isinstance(protected, (set, frozenset, dict)) else set(protected)
        return list(islice(self._victims(protected), n))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    def __iter__(self):
        return iter(list(self._state))

    def is_tail(self, key: Hashable) -> bool:
        """Whether `key` was saved as the tail of its request's prefix and has not been read since."""
        return key in self._tails

    def __len__(self) -> int:
        return len(self._state)

    # ---- inside -----------------------------------------------------------------------------

    def _victims(self, protected) -> Iterator:
        """The unprotected keys in eviction order, nothing changed: of the levels' oldest keys, the one
        whose age times 2^level is the largest (ties: the higher level), then the hot segment's."""
        now, heads = self._clock, []
        for level, segment in enumerate(self._levels):
            if segment:
                keys = ((key, stamp) for key, stamp in segment.items() if key not in protected)
                head = next(keys, None)
                if head is not None:
                    heads.append([(now - head[1]) << level, level, head[0], keys])
        while heads:
            best = max(heads)
            yield best[2]
            head = next(best[3], None)
            if head is None:
                heads.remove(best)
            else:
                best[0], best[2] = (now - head[1]) << best[1], head[0]
        yield from (key for key in self._hot if key not in protected)

    def _drop(self, key: Hashable) -> None:
        state = self._state.pop(key)
        del self._segments[state & SEGMENT][key]
        if state & TAIL:
            del self._tails[key]
        if state & SAMPLED:
            self.classes.gone(key)

    def _untail(self, key: Hashable) -> None:
        """A later save extends this tail: it joins its class without the tail (never a worse level)."""
        state = self._state[key] & ~TAIL
        index, level = state & SEGMENT, self.classes.level(self._tails.pop(key))
        if index != HOT and level < index:
            del self._segments[index][key]
            self._levels[level][key] = self._clock  # at the young end of its new level
            state = (state & ~SEGMENT) | level
        self._state[key] = state

    def _fit_hot(self) -> None:
        while len(self._hot) > self.hot_share * len(self._state):
            key, _ = self._hot.popitem(last=False)  # back among the blocks read once, at the young end
            self._levels[0][key] = self._clock
            self._state[key] = (self._state[key] & ~SEGMENT) | READ

    def _observe(self, key: Hashable) -> None:
        """Feed the shadows with a sampled key; the hot segment follows the one hitting more."""
        for shadow in self._shadows:
            shadow.access(key)
        self._seen += 1
        if self._seen >= self._decay_every:
            self._seen = 0
            for shadow in self._shadows:
                shadow.score /= 2
        share = HOT_SHARE if self._shadows[1].score > self._shadows[0].score else 0.0
        if share != self.hot_share:
            self.hot_share = share
            self._fit_hot()
