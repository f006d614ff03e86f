"""Fixed-size page allocator over one arena, with allocations tagged by token.

Calls, in the order they happen:
    allocate(token, nbytes) -> runs | None   # None: not enough free pages, nothing changed
    grant(token, max_pages) -> runs          # page credit: up to max_pages free pages at once
    free(token, runs) -> bool                # False: those runs are not that token's
    reserve(token, runs) -> bool             # restart recovery: take exactly these pages
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

    def _own(self, token: str, runs: list[tuple[int, int]]) -> None:
        if self.owners:
            self._owned.setdefault(token, set()).update(runs)

    def _overlaps_free(self, first: int, count: int) -> bool:
        i = bisect.bisect_left(self._free, [first, count])
        return (i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > first) or \
            (i < len(self._free) and self._free[i][0] < first + count)

    def _is_free(self, first: int, count: int) -> bool:
        return any(f <= first and first + count <= f + c for f, c in self._free)

    def _take_exact(self, first: int, count: int) -> None:
        for i, (f, c) in enumerate(self._free):
            if f <= first and first + count <= f + c:
                pieces = [[f, first - f], [first + count, f + c - first - count]]
                self._free[i : i + 1] = [p for p in pieces if p[1] > 0]
                return
        raise AssertionError("pages are not free")

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
