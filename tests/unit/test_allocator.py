from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.core.specs import PageRun
from kvstore.core.pages import PageAllocator

PAGES, PAGE = 64, 4096


def test_a_block_spans_several_pages_and_prefers_one_run():
    allocator = PageAllocator(PAGES, PAGE)
    runs = allocator.allocate("t", 3 * PAGE + 1)
    assert runs == [PageRun(first=0, count=4)]
    assert allocator.free_pages == PAGES - 4


def test_no_room_returns_none_and_changes_nothing():
    allocator = PageAllocator(4, PAGE)
    assert allocator.allocate("t", 5 * PAGE) is None
    assert allocator.free_pages == 4


def test_fragmented_arena_still_takes_a_block_in_several_runs():
    allocator = PageAllocator(4, PAGE)
    held = [allocator.allocate(f"t{i}", PAGE) for i in range(4)]
    assert allocator.free("t0", held[0]) and allocator.free("t2", held[2])
    runs = allocator.allocate("big", 2 * PAGE)
    assert sorted((r.first, r.count) for r in runs) == [(0, 1), (2, 1)]


def test_only_the_owner_token_frees():
    allocator = PageAllocator(4, PAGE)
    runs = allocator.allocate("owner", PAGE)
    assert not allocator.free("intruder", runs)
    assert allocator.free_pages == 3
    assert allocator.free("owner", runs)
    assert not allocator.free("owner", runs)  # a duplicate free changes nothing
    assert allocator.free_pages == 4
    assert allocator.free("nobody", [])  # nothing to free, whoever asks


def test_a_pool_without_owners_refuses_a_run_freed_twice_by_the_free_list():
    allocator = PageAllocator(8, PAGE, owners=False)
    a, b = allocator.allocate("directory", 2 * PAGE), allocator.allocate("directory", 2 * PAGE)
    assert allocator._owned == {}  # nothing kept per allocation
    assert allocator.free("directory", a)
    assert not allocator.free("directory", a)  # overlaps the free list: a double free
    assert not allocator.free("directory", [PageRun(first=a[0].first + 1, count=2)])  # in part
    assert allocator.free_pages == 6 and allocator.free("directory", b) and allocator.free_pages == 8


class AllocatorMachine(RuleBasedStateMachine):
    """Against a recorder: pages never overlap, none are lost, frees merge back."""

    OWNERS = True

    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(PAGES, PAGE, owners=self.OWNERS)
        self.held: dict[str, list[PageRun]] = {}
        self.counter = 0

    @rule(pages=st.integers(1, 20))
    def allocate(self, pages):
        self.counter += 1
        token = f"t{self.counter}"
        free_before = self.allocator.free_pages
        runs = self.allocator.allocate(token, pages * PAGE - 1)
        if runs is None:
            assert free_before < pages and self.allocator.free_pages == free_before
        else:
            assert sum(r.count for r in runs) == pages
            self.held[token] = runs

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        token = data.draw(st.sampled_from(sorted(self.held)))
        assert self.allocator.free(token, self.held.pop(token))

    @invariant()
    def pages_are_conserved_and_disjoint(self):
        used = [p for runs in self.held.values() for r in runs for p in range(r.first, r.first + r.count)]
        assert len(used) == len(set(used))
        assert all(0 <= p < PAGES for p in used)
        assert self.allocator.free_pages + len(used) == PAGES

    @invariant()
    def empty_arena_is_one_run(self):
        if not self.held:
            assert self.allocator.allocate("probe", PAGES * PAGE) == [PageRun(first=0, count=PAGES)]
            self.allocator.free("probe", [PageRun(first=0, count=PAGES)])


class UnownedAllocatorMachine(AllocatorMachine):
    OWNERS = False  # the directory's pools


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestUnownedAllocatorMachine = UnownedAllocatorMachine.TestCase
TestUnownedAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _pages(runs) -> set[int]:
    return {page for first, count in runs for page in range(first, first + count)}


@settings(max_examples=300, deadline=None)
@given(free=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 12)), max_size=12),
       named=st.lists(st.tuples(st.integers(0, 220), st.integers(1, 6)), max_size=40))
def test_reserve_all_takes_the_free_pages_named_and_counts_the_rest(free, named):
    """A restart's one-pass reservation against a free list cut into pieces: afterwards the free
    pages are exactly those free before and not named; pages named but not free are counted, as
    are runs that overlap another."""
    pool = PageAllocator(0, PAGE, owners=False)
    granted: set[int] = set()
    for first, count in free:  # disjoint grants: add_free takes no overlap
        if not _pages([(first, count)]) & granted:
            pool.add_free([PageRun(first=first, count=count)])
            granted |= _pages([(first, count)])
    outside, overlapping = pool.reserve_all(named)
    left = pool.free_runs()
    assert _pages(left) == granted - _pages(named)
    assert pool.free_pages == len(granted - _pages(named))
    assert outside == len(_pages(named) - granted)
    assert all(count > 0 for _, count in left)
    assert all(a[0] + a[1] < b[0] for a, b in zip(left, left[1:]))  # sorted, apart, merged
    ordered = sorted(named)
    assert overlapping == sum(1 for k, (first, _) in enumerate(ordered)
                              if any(f <= first < f + c for f, c in ordered[:k]))


def test_reserve_all_is_one_pass_on_a_free_list_of_many_runs():
    """Every other page free (20,000 runs), all of them named, in reverse order: one sorted sweep
    takes them all (a search of the free list per run, each cutting it, is quadratic here)."""
    pool = PageAllocator(0, PAGE, owners=False)
    pool.add_free([PageRun(first=2 * k, count=1) for k in range(20_000)])
    assert pool.reserve_all([(2 * k, 1) for k in reversed(range(20_000))]) == (0, 0)
    assert pool.free_pages == 0 and pool.free_runs() == []


def test_release_gives_back_every_run_a_token_holds_and_only_its_own():
    allocator = PageAllocator(8, PAGE)
    mine = [allocator.allocate("move", PAGE), allocator.allocate("move", 2 * PAGE)]
    other = allocator.allocate("other", PAGE)
    assert sorted(allocator.release("move")) == sorted((r.first, r.count) for runs in mine for r in runs)
    assert allocator.free_pages == 7 and allocator.owned_tokens() == {"other"}
    assert allocator.release("move") == []  # twice: nothing more
    assert allocator.owns("other", other)
