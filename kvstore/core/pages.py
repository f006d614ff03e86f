"""Fixed-size page allocator over one arena, with allocations tagged by token.

Calls, in the order they happen:
    allocate(token, nbytes) -> runs | None   # None: not enough free pages, nothing changed
    grant(token, max_pages) -> runs          # page credit: up to max_pages free pages at once
    free(token, runs) -> bool                # False: those runs are not that token's
    release(token) -> runs                   # every page the token holds goes back
    reserve(token, runs) -> bool             # restart recovery: take exactly these pages
    reserve_all(runs) -> (outside, overlapping)  # the same for every replica at once (a pool without owners)
    reset()                                  # new epoch: every page is free again
    add_free(runs)                           # a pool fed by grants: these pages join it

The worker runs one per tier; the directory runs one per memory tier of each
worker over the pages that worker granted it, so placing a block needs no
call to the worker.

A block may span several pages; the allocator prefers one contiguous run
(first fit) and falls back to several runs, so a fragmented arena still
accepts a block while it has enough pages in total.

`owners=False` keeps no record of what each token holds (the directory's pools,
which hand out pages under one tag): a free is checked against the free list
instead (a run freed twice overlaps it), and a million allocated blocks cost
about 120 MiB less.
"""

from __future__ import annotations

import bisect
import threading

from kvstore.core.specs import PageRun


def pages_for(nbytes: int, page_bytes: int) -> int:
    """Pages of `page_bytes` that `nbytes` take: a block takes whole pages."""
    return -(-nbytes // page_bytes)


_COUNT_BITS = 32  # reserve_all packs a run as first << 32 | count
_PAST = float("inf")  # a count larger than any: [first, _PAST] sorts after every run starting at `first`


class PageAllocator:
    def __init__(self, num_pages: int, page_bytes: int, owners: bool = True) -> None:
        assert num_pages >= 0 and page_bytes > 0, "an arena needs a page size"
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.owners = owners
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._free: list[list[int]] = [[0, self.num_pages]] if self.num_pages else []  # sorted [first, count]
            self._owned: dict[str, set[tuple[int, int]]] = {}
            self.free_pages = self.num_pages

    def pages_for(self, nbytes: int) -> int:
        return pages_for(nbytes, self.page_bytes)

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as sorted, disjoint (first, count) runs."""
        with self._lock:
            return [(first, count) for first, count in self._free]

    def allocate(self, token: str, nbytes: int, contiguous: bool = False) -> list[PageRun] | None:
        runs = self.allocate_pairs(token, nbytes, contiguous)
        return None if runs is None else [PageRun(first=f, count=c) for f, c in runs]

    def allocate_pairs(self, token: str, nbytes: int, contiguous: bool = False) -> list[tuple[int, int]] | None:
        """`allocate` as (first, count) pairs: no model per run, for callers that place many blocks."""
        need = self.pages_for(nbytes)
        assert need > 0, "allocate needs a positive size"
        with self._lock:
            if need > self.free_pages:
                return None
            runs = self._take_contiguous(need) or (None if contiguous else self._take_scattered(need))
            if runs is None:
                return None
            self.free_pages -= need
            self._own(token, runs)
        return runs

    def allocate_many(self, token: str, sizes: list[int]) -> list[list[tuple[int, int]] | None]:
        """`allocate_pairs` for each size in turn; when one free run holds them all, they are cut
        from it in one step (a save of many blocks into an unfragmented pool)."""
        needs = [self.pages_for(n) for n in sizes]
        total = sum(needs)
        with self._lock:
            whole = self._take_contiguous(total) if 0 < total <= self.free_pages else None
            if whole is not None:
                self.free_pages -= total
                first, runs = whole[0][0], []
                for need in needs:
                    runs.append([(first, need)])
                    first += need
                self._own(token, [r[0] for r in runs])
                return runs
        return [self.allocate_pairs(token, n) for n in sizes]

    def grant(self, token: str, max_pages: int) -> list[PageRun]:
        """Up to `max_pages` free pages, in as few runs as the free list allows, tagged by `token`
        (a directory's page credit); empty when nothing is free."""
        with self._lock:
            need = min(max_pages, self.free_pages)
            if need <= 0:
                return []
            runs = self._take_contiguous(need) or self._take_scattered(need)
            self.free_pages -= need
            self._own(token, runs)
        return [PageRun(first=f, count=c) for f, c in runs]

    def free(self, token: str, runs: list) -> bool:
        """`runs`: PageRuns or (first, count) pairs."""
        pairs = {(r.first, r.count) if isinstance(r, PageRun) else (r[0], r[1]) for r in runs}
        with self._lock:
            if not self.owners:
                if any(self._overlaps_free(first, count) for first, count in pairs):
                    return False
            else:
                owned = self._owned.get(token, set())
                if not pairs <= owned:
                    return False
                owned -= pairs
                if not owned:
                    self._owned.pop(token, None)
            for first, count in pairs:
                self._give_back(first, count)
                self.free_pages += count
        return True

    def release(self, token: str) -> list[tuple[int, int]]:
        """Every run `token` holds, freed (an allocator with owners)."""
        with self._lock:
            runs = sorted(self._owned.pop(token, ()))
            for first, count in runs:
                self._give_back(first, count)
                self.free_pages += count
        return runs

    def add_free(self, runs: list[PageRun]) -> None:
        """Pages granted to this pool: they become free here (they must not overlap what it has)."""
        with self._lock:
            for run in runs:
                self._give_back(run.first, run.count)
                self.num_pages += run.count
                self.free_pages += run.count

    def reserve(self, token: str, runs: list) -> bool:
        """Take exactly these pages (PageRuns or pairs) for `token` (they must all be free); False
        changes nothing."""
        with self._lock:
            wanted = [(r.first, r.count) if isinstance(r, PageRun) else (r[0], r[1]) for r in runs]
            if not all(self._is_free(first, count) for first, count in wanted):
                return False
            for first, count in wanted:
                self._take_exact(first, count)
                self.free_pages -= count
            self._own(token, wanted)
        return True

    def reserve_all(self, runs) -> tuple[int, int]:
        """Take every free page that these (first, count) runs name, in one pass (a restart: the pages of
        all of a tier's replicas, in any order, against a free list of any length), for a pool that
        keeps no owners. Returns (pages named that were not free, runs that overlap another): both
        0 when every replica's pages were granted and no two replicas share a page."""
        assert not self.owners, "reserve_all keeps no record of who holds what"
        keys = sorted(first << _COUNT_BITS | count for first, count in runs)  # one int a run: 16 MiB a million
        overlaps = [0]
        with self._lock:
            new, taken, named = _without(self._free, _union(keys, overlaps))
            self._free = new
            self.free_pages -= taken
        return named - taken, overlaps[0]

    def _own(self, token: str, runs: list[tuple[int, int]]) -> None:
        if self.owners:
            self._owned.setdefault(token, set()).update(runs)

    def _overlaps_free(self, first: int, count: int) -> bool:
        i = bisect.bisect_left(self._free, [first, count])
        return (i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > first) or \
            (i < len(self._free) and self._free[i][0] < first + count)

    def _holding(self, first: int, count: int) -> int | None:
        """The index of the free run that holds these pages, else None (a search, not a walk: a free
        list that churn has cut into many runs stays cheap to ask)."""
        i = bisect.bisect_right(self._free, [first, _PAST]) - 1  # the last run starting at or before `first`
        if i >= 0 and first + count <= self._free[i][0] + self._free[i][1]:
            return i
        return None

    def _is_free(self, first: int, count: int) -> bool:
        return self._holding(first, count) is not None

    def _take_exact(self, first: int, count: int) -> None:
        i = self._holding(first, count)
        assert i is not None, "pages are not free"
        f, c = self._free[i]
        pieces = [[f, first - f], [first + count, f + c - first - count]]
        self._free[i : i + 1] = [p for p in pieces if p[1] > 0]

    def owns(self, token: str, runs: list[PageRun]) -> bool:
        """Whether `token` holds exactly these runs (a writer checks before it writes)."""
        with self._lock:
            return {(r.first, r.count) for r in runs} <= self._owned.get(token, set())

    def owned_tokens(self) -> set[str]:
        with self._lock:
            return set(self._owned)

    def _take_contiguous(self, need: int) -> list[tuple[int, int]] | None:
        for i, (first, count) in enumerate(self._free):
            if count >= need:
                if count == need:
                    del self._free[i]
                else:
                    self._free[i] = [first + need, count - need]
                return [(first, need)]
        return None

    def _take_scattered(self, need: int) -> list[tuple[int, int]]:
        runs = []
        while need:
            first, count = self._free[0]
            take = min(count, need)
            runs.append((first, take))
            if take == count:
                del self._free[0]
            else:
                self._free[0] = [first + take, count - take]
            need -= take
        return runs

    def _give_back(self, first: int, count: int) -> None:
        i = bisect.bisect_left(self._free, [first, count])
        self._free.insert(i, [first, count])
        # merge with the right neighbour, then the left one
        if i + 1 < len(self._free) and first + count == self._free[i + 1][0]:
            self._free[i][1] += self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:
            self._free[i - 1][1] += self._free.pop(i)[1]


def _union(keys: list[int], overlaps: list[int]):
    """Sorted packed runs (first << _COUNT_BITS | count) as the sorted, disjoint [start, end) stretches
    they cover; overlaps[0] counts the runs that overlap one before them."""
    mask = (1 << _COUNT_BITS) - 1
    start = end = -1
    for key in keys:
        first = key >> _COUNT_BITS
        stop = first + (key & mask)
        if first <= end:  # touches or overlaps the stretch so far
            overlaps[0] += first < end
            end = max(end, stop)
            continue
        if end >= 0:
            yield start, end
        start, end = first, stop
    if end >= 0:
        yield start, end


def _without(free: list[list[int]], stretches) -> tuple[list[list[int]], int, int]:
    """The free runs less the sorted, disjoint stretches, in one sweep over both; returns (free runs
    left, pages taken, pages the stretches cover: those outside the free runs were not taken)."""
    left: list[list[int]] = []
    taken = named = 0
    i, n = 0, len(free)
    at = free[0][0] if free else 0  # where the part of free[i] not yet handed to `left` or taken begins

    def keep_to(stop: int) -> None:
        if at < stop:
            left.append([at, stop - at])

    for start, end in stretches:
        named += end - start
        while i < n and free[i][0] + free[i][1] <= start:  # free runs that end before this stretch
            keep_to(free[i][0] + free[i][1])
            i += 1
            at = free[i][0] if i < n else 0
        while i < n and free[i][0] < end:  # free runs this stretch takes from
            stop = free[i][0] + free[i][1]
            cut = max(start, at)
            keep_to(cut)
            taken += min(end, stop) - cut
            if stop > end:
                at = end
                break
            i += 1
            at = free[i][0] if i < n else 0
    while i < n:
        keep_to(free[i][0] + free[i][1])
        i += 1
        at = free[i][0] if i < n else 0
    return left, taken, named
