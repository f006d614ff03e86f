"""A save's hints, over HTTP against the directory in this process (SQLite and PostgreSQL)."""

from __future__ import annotations

from tests.calls import chain, complete


def test_a_saves_hints_reach_the_tiers_policy_and_bad_ones_are_refused(stack):
    """Hints travel with a save into the placement tier's eviction policy (its last block marked a
    tail); malformed hints are a 400 and change nothing."""
    from kvstore.core import specs
    from kvstore.directory.tier_policies import VictimRow
    from tests.calls import BLOCK

    hashes = chain(3)
    body = specs.PrepareStore(namespace_id=stack.namespace_id, hints=specs.RequestHints(
        session_id="chat-7", retain="turn", priority=2), blocks=[
        specs.BlockToStore(hash=h, parent=p, nbytes=BLOCK) for h, p in zip(hashes, [None, *hashes[:-1]])])
    complete(stack, stack.client.prepare_store(body))
    policies = stack.service.policies
    keys = [hit.block_id for hit in stack.service.index.lookup(stack.namespace_id, hashes)]  # the policy's keys
    expected = [hints for _, hints in policies.expected()]  # kept until the tier's policy is built
    assert [key[1:] for key, _ in policies.expected()] == [(k,) for k in keys]  # by block id once committed
    assert [(h.retain, h.priority, h.tail) for h in expected] == [("turn", 2, False)] * 2 + [("turn", 2, True)]
    tier = next(iter(stack.service.index.tiers.values()))
    rows = [VictimRow(key=k, parent=None, last_access=0.0, depth=0, hit_count=0, nbytes=BLOCK, pinned=False, row=k)
            for k in keys]
    policies.victims(tier, rows, set(), to_free=0, limit=0)  # what the first demotion does: build it
    eviction = policies.eviction_of(tier)
    assert eviction.is_tail(keys[-1]) and not eviction.is_tail(keys[0]) and not policies.expected()
    for bad in ({"retain": "forever"}, {"priority": 1000}, {"session_id": "x" * 257}, {"other": 1}):
        answer = stack.http.post("/v1/store/prepare", json={"namespace_id": stack.namespace_id, "hints": bad,
                                                            "blocks": [{"hash": "ab", "nbytes": BLOCK}]})
        assert (answer.status_code, answer.json()["error"]) == (400, "invalid"), bad
    assert stack.client.stats().reservations == 0
