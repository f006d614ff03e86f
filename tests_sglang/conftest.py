"""A kvstore stack (directory + worker processes from this environment) for the SGLang HiCache
contract tests, and a host KV pool laid out as SGLang's.

SGLang's own host pool class (`MHATokenToKVPoolHost`) cannot be built on this CPU host: importing
it imports SGLang's model configurations and kernels (torchvision, tvm_ffi), which have no CPU
build here. `HostPool` lays pages out as SGLang 0.5.23's MHA host pool does (its `init_kv_buffer`,
`get_page_buffer_meta`, `get_data_page`, `set_from_flat_data_page`), for the three layouts the
backend takes; everything else is SGLang's own (HiCacheStorage, its config, its factory)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kvstore.client import DirectoryClient
from tests.helpers import free_port, kvstore_cmd, spawn, stop, wait_http, wait_until


class HostPool:
    """K and V of `layer_num` layers for `size` tokens in pages of `page_size`, as SGLang's MHA host pool."""

    def __init__(self, layout: str, layer_num: int = 3, head_num: int = 2, head_dim: int = 16, page_size: int = 4,
                 pages: int = 16, dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.layer_num, self.head_num, self.head_dim = layout, layer_num, head_num, head_dim
        self.v_head_dim, self.page_size, self.dtype = head_dim, page_size, dtype
        self.page_num, self.size = pages, pages * page_size
        dims = {"layer_first": (2, layer_num, self.size, head_num, head_dim),
                "page_first": (2, self.size, layer_num, head_num, head_dim),
                "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))

    def page(self, index: int) -> torch.Tensor:
        """Page `index`'s K and V in every layer, as [2, layer, token, head, dim] (a copy)."""
        p = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index * p:(index + 1) * p].clone()
        if self.layout == "page_first":
            return self.kv_buffer[:, index * p:(index + 1) * p].transpose(1, 2).clone()
        return self.kv_buffer[:, index].clone()

    def indices(self, first_page: int, n: int) -> torch.Tensor:
        return torch.arange(first_page * self.page_size, (first_page + n) * self.page_size)

    # ---- what SGLang's HiCache storage backends call --------------------------------------

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base, v_offset = self.kv_buffer.data_ptr(), self.kv_buffer[0].numel() * item
        ptrs, indices = [], indices.tolist()
        if self.layout == "layer_first":
            for i in range(0, len(indices), self.page_size):
                for layer in range(self.layer_num):
                    k = base + indices[i] * self.head_num * self.head_dim * item + \
                        layer * self.size * self.head_num * self.head_dim * item
                    ptrs += [k, k + v_offset]
            return ptrs, [item * self.page_size * self.head_num * self.head_dim] * len(ptrs)
        for i in range(0, len(indices), self.page_size):
            k = base + indices[i] * self.layer_num * self.head_num * self.head_dim * item
            ptrs += [k, k + v_offset]
        return ptrs, [self.layer_num * item * self.page_size * self.head_num * self.head_dim] * len(ptrs)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            page = self.kv_buffer[:, index // self.page_size:index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index // self.page_size:index // self.page_size + 1] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self.procs["directory"] = spawn(kvstore_cmd(
            "directory", "serve", "--insecure-no-auth", "--port", str(self.port), "--data-dir", str(self.tmp / "var"),
            "--heartbeat-timeout", "3"), self.tmp / "directory.log")
        wait_http(self.url + "/healthz", proc=self.procs["directory"])
        self.procs["worker"] = spawn(kvstore_cmd(
            "worker", "serve", "--directory-url", self.url, "--name", "w0", "--dram-bytes", "64MiB",
            "--page-bytes", "4KiB", "--arena-dir", str(self.tmp / "arenas")), self.tmp / "worker.log")
        client = DirectoryClient(self.url)
        wait_until(lambda: any(w.state == "active" for w in client.workers()), 120, "worker up")

    def stop(self, name: str | None = None) -> None:
        for key in [name] if name else list(reversed(list(self.procs))):
            proc = self.procs.pop(key, None)
            if proc is not None:
                stop(proc)


@pytest.fixture
def stack(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_ARENA_DIR", str(tmp_path / "arenas"))
    s = Stack(tmp_path)
    s.start()
    yield s
    s.stop()
