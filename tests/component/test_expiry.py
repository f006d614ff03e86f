"""Reservations and leases that are never completed expire (short TTLs here)."""

from __future__ import annotations

import pytest

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from tests.stacks import make_settings
from tests.calls import chain, complete, hits, prepare
from tests.helpers import wait_until


@pytest.fixture
def directory_settings(database_url):
    return make_settings(database_url, reservation_ttl_s=0.5, lease_ttl_s=2.0)  # a lease outlives a stats call


def test_a_never_completed_store_expires_and_is_never_visible(stack):
    hashes = chain(2)
    prepared = prepare(stack, hashes)
    wait_until(lambda: stack.client.stats().reservations == 0, 10, "reservation reaped")
    assert hits(stack, hashes) == 0
    assert stack.free_pages() == 32
    with pytest.raises(KVStoreError) as info:  # the late completion changes nothing
        complete(stack, prepared)
    assert info.value.kind == "conflict"
    assert "expired before completion" in str(info.value)
    assert hits(stack, hashes) == 0


def test_an_unreleased_lease_expires_and_its_pins_go(stack):
    hashes = chain(2)
    complete(stack, prepare(stack, hashes))
    stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes))
    assert stack.client.stats().pins == 2
    wait_until(lambda: stack.client.stats().pins == 0, 10, "lease reaped")
    assert stack.client.stats().leases_active == 0
    assert hits(stack, hashes) == 2  # the blocks stay loadable by others


