"""One contract for every eviction policy, checked against a recorder (no phantom, no lost keys)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.core.errors import KVStoreError
from kvstore.policies import EVICTION, make_eviction

CAPACITY = 8


@pytest.mark.parametrize("name", sorted(EVICTION))
def test_evict_is_atomic_and_never_takes_a_protected_key(name):
    policy = make_eviction(name, CAPACITY)
    for key in range(4):
        policy.insert(key, key - 1 if key else None)
    assert policy.evict(3, protected={0, 1}) is None  # only 2 unprotected: nothing changes
    assert len(policy) == 4 and all(k in policy for k in range(4))
    victims = policy.evict(2, protected={0, 1})
    assert sorted(victims) == [2, 3] and len(policy) == 2


@pytest.mark.parametrize("name", ["lru", "prefix-lru"])
def test_recency_orders_victims(name):
    # store [0..3] (one chain each) -> touch 0 -> evict 1 takes the least recently used, 1
    policy = make_eviction(name, CAPACITY)
    for key in range(4):
        policy.insert(key)
    policy.touch(0)
    assert policy.evict(1) == [1]


def test_prefix_lru_cuts_cold_chains_from_the_tail():
    # chain a0 <- a1 <- a2 stored first (cold), then b0; evicting 2 takes a2 then a1, never a0 first
    policy = make_eviction("prefix-lru", CAPACITY)
    policy.insert("a0")
    policy.insert("a1", "a0")
    policy.insert("a2", "a1")
    policy.insert("b0")
    assert policy.evict(2) == ["a2", "a1"]
    assert "a0" in policy


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(KVStoreError, match="unknown eviction policy"):
        make_eviction("random", 4)


class PolicyMachine(RuleBasedStateMachine):
    """Every policy against a recorder of inserts, evictions and removals."""

    def __init__(self):
        super().__init__()
        self.policies = {name: make_eviction(name, CAPACITY) for name in EVICTION}
        self.held: dict[str, set] = {name: set() for name in EVICTION}
        self.next_key = 0

    @rule(chain=st.booleans())
    def insert(self, chain):
        key, self.next_key = self.next_key, self.next_key + 1
        for name, policy in self.policies.items():
            if len(self.held[name]) >= CAPACITY:
                victims = policy.evict(1, protected=())
                assert victims is not None and len(victims) == 1 and victims[0] in self.held[name]
                self.held[name] -= set(victims)
            policy.insert(key, key - 1 if chain and key else None)
            self.held[name].add(key)

    @precondition(lambda self: self.next_key > 0)
    @rule(data=st.data())
    def touch_or_remove(self, data):
        key = data.draw(st.integers(0, self.next_key - 1))
        remove = data.draw(st.booleans())
        for name, policy in self.policies.items():
            if key in self.held[name]:
                if remove:
                    policy.remove(key)
                    self.held[name].discard(key)
                else:
                    policy.touch(key)

    @precondition(lambda self: self.next_key > 0)
    @rule(data=st.data(), n=st.integers(1, 4))
    def evict_with_protection(self, data, n):
        protected = set(data.draw(st.lists(st.integers(0, self.next_key - 1), max_size=4)))
        for name, policy in self.policies.items():
            before = set(self.held[name])
            victims = policy.evict(n, protected)
            if victims is None:
                assert len(before - protected) < n
            else:
                assert len(victims) == n and not set(victims) & protected and set(victims) <= before
                self.held[name] -= set(victims)

    @invariant()
    def policy_holds_exactly_the_recorded_keys(self):
        for name, policy in self.policies.items():
            assert len(policy) == len(self.held[name]), name
            assert all(k in policy for k in self.held[name]), name


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_doorkeeper_admits_on_the_second_sighting_and_forgets_when_full():
    from kvstore.policies import Admit, Reject, make_admission

    from kvstore.policies.admission import Doorkeeper

    door = Doorkeeper(2, window=1)
    assert isinstance(make_admission("doorkeeper", 2).admit("a"), Reject)
    assert isinstance(door.admit("a"), Reject)
    assert isinstance(door.admit("a"), Admit)
    door.admit("b")  # the window holds 2 keys: a, b
    door.admit("c")  # full: cleared, then c
    assert isinstance(door.admit("a"), Reject)


def test_an_admission_chain_answers_with_the_first_refusal():
    from kvstore.policies import Admit, AdmissionChain, Throttled

    class Busy:
        def admit(self, key):
            return Throttled(retry_after_s=0.5)

    assert AdmissionChain([]).admit("k") == Admit()
    assert AdmissionChain([Busy()]).admit("k") == Throttled(0.5)
