"""The directory through real HTTP on a migrated database, with a worker control endpoint
(the real page allocator, without NIXL memory) registered like a worker would."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import httpx
import pytest

from kvstore.client import DirectoryClient
from kvstore.core import specs
from kvstore.core.keys import Namespace
from kvstore.directory.app import create_app
from kvstore.directory.settings import DirectorySettings
from kvstore.core.pages import PageAllocator
from kvstore.worker.control import ControlServer
from tests.helpers import ServerThread

NS = Namespace(model_id="tiny", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)
PAGE = 128


@dataclass
class Stack:
    url: str
    client: DirectoryClient
    http: httpx.Client
    allocator: PageAllocator
    namespace_id: str
    settings: DirectorySettings
    service: object = None  # the DirectoryService behind the HTTP API (same process)

    def free_pages(self, worker: str = "w0") -> int:
        """Free DRAM pages as the directory accounts them; its page credit must say the same."""
        tier = next(t for t in self.client.tiers() if t.kind == "dram" and t.worker == worker)
        assert tier.credit_free_bytes == tier.capacity_bytes - tier.used_bytes, "page pool and used_bytes disagree"
        return (tier.capacity_bytes - tier.used_bytes) // PAGE

    def register_worker(self, name: str = "w0", control_url: str = "") -> specs.Registered:
        return self.client.register_worker(specs.WorkerRegistration(
            name=name, agent_name=f"{name}-agent", agent_metadata=base64.b64encode(b"md").decode(),
            control_url=control_url, pid=1, backends=["UCX"],
            tiers=[specs.TierSpec(kind="dram", capacity_bytes=self.allocator.num_pages * PAGE,
                                  page_bytes=PAGE, base_addr=1 << 20, high_watermark=1.0, low_watermark=1.0)]))


def make_settings(database_url: str, **overrides) -> DirectorySettings:
    values = dict(database_url=database_url, heartbeat_timeout_s=60, reaper_interval_s=0.1)
    return DirectorySettings(**{**values, **overrides})


@pytest.fixture
def directory_settings(database_url):
    return make_settings(database_url)


@pytest.fixture
def stack(directory_settings):
    allocator = PageAllocator(num_pages=32, page_bytes=PAGE)  # 32 pages: room for 16 blocks of NS
    control = ControlServer({"dram": allocator})
    control.start()
    app = create_app(directory_settings)
    with ServerThread(app) as server:
        client = DirectoryClient(server.url)
        s = Stack(server.url, client, httpx.Client(base_url=server.url), allocator,
                  client.register_namespace(NS), directory_settings, app.state.service)
        s.register_worker(control_url=control.url)
        yield s
        client.close()
        s.http.close()
    control.stop()
