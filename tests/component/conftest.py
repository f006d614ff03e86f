"""The directory through real HTTP on a migrated database, with a worker control endpoint
(the real page allocator, without NIXL memory) registered like a worker would."""

from __future__ import annotations

import pytest

from tests.stacks import directory_stack, make_settings


@pytest.fixture
def directory_settings(database_url):
    return make_settings(database_url)


@pytest.fixture
def stack(directory_settings):
    with directory_stack(directory_settings) as s:  # 32 pages: room for 16 blocks of NS
        yield s


@pytest.fixture
def secure(database_url):
    """The stack with credentials required; its client holds an admin token."""
    with directory_stack(make_settings(database_url, require_auth=True)) as s:
        yield s
