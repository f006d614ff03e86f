"""The same-host path: a worker hands its DRAM arena (a memfd) over a Unix socket, and a connector
on its host copies blocks straight into and out of it; the directory's protocol is unchanged (the
worker checks every saved block's checksum with `--verify-writes`). NIXL carries the same calls
when sharing is off, for a user the worker refuses, and into a restarted worker until it is
mapped again."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.lib.array_utils import byte_bounds

from kvstore.client import DirectoryClient
from kvstore.connector import KVStoreClient, Namespace
from kvstore.connector.arenas import LocalArenas
from kvstore.connector.vllm.worker import PagedKVWorker
from kvstore.core import specs
from kvstore.core.keys import block_hashes
from tests.fault.prompts import NS, load, prompt, save
from tests.helpers import wait_until
from tests.paged import load_pages, save_pages
from tests.stacks import ProcessStack


@pytest.fixture
def arenas(monkeypatch):
    """The socket folder (a fresh one under /tmp, where another user could reach it)."""
    top = Path(tempfile.mkdtemp(prefix="kvstore-arenas-"))
    monkeypatch.setenv("KVSTORE_ARENA_DIR", str(top / "arenas"))  # the connector's side
    yield top / "arenas"
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def stack(tmp_path, arenas):
    """A directory that verifies every write with the worker, and a worker sharing its arena."""
    with ProcessStack(tmp_path, directory_args=["--verify-writes"], worker_args=["--arena-dir", str(arenas)]) as s:
        yield s


def mapped(client: KVStoreClient) -> set[str]:
    return set(client.copier.arenas._arenas)


@pytest.mark.parametrize("same_host", ["auto", "off"])
def test_blocks_round_trip_exactly_copied_or_over_nixl(stack, same_host):
    with KVStoreClient(stack.url, NS, staging_bytes=4 * NS.block_nbytes, same_host=same_host) as client:
        hashes, blocks = prompt(1)
        assert save(client, hashes, blocks) == 4  # the worker found every checksum in its arena
        n, out = load(client, hashes)
        assert n == 4 and all(np.array_equal(a, b) for a, b in zip(out, blocks))
        assert mapped(client) == ({"w0"} if same_host == "auto" else set())


def test_the_arena_socket_is_the_owners_alone(stack, arenas):
    socket_path = arenas / "w0.sock"
    assert (socket_path.stat().st_mode & 0o777) == 0o600
    assert (arenas.stat().st_mode & 0o777) == 0o700
    # even where the file modes let another user connect, the worker checks the peer's uid
    for path, mode in ((arenas.parent, 0o755), (arenas, 0o755), (socket_path, 0o666)):
        path.chmod(mode)
    probe = ("import socket; s = socket.socket(socket.AF_UNIX); "
             f"s.connect({str(socket_path)!r}); m, fds, _, _ = socket.recv_fds(s, 4096, 1); print(len(fds), m.decode())")
    other = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", probe], cwd="/",
                           capture_output=True, text=True, timeout=30)
    assert other.returncode == 0 and other.stdout.startswith("0 ") and "unauthorized" in other.stdout, \
        other.stdout + other.stderr
    own = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert own.stdout.startswith("1 ") and '"agent_name"' in own.stdout, own.stdout + own.stderr


def test_a_restarted_worker_is_mapped_again_and_its_old_arena_never_written(stack):
    with KVStoreClient(stack.url, NS, staging_bytes=4 * NS.block_nbytes) as client:
        assert save(client, *prompt(1)) == 4
        old = client.copier.arenas._arenas["w0"]
        stack.kill(stack.worker)
        assert stack.start_worker() == 2
        hashes, blocks = prompt(2)
        assert save(client, hashes, blocks) == 4
        new = client.copier.arenas._arenas["w0"]
        assert new is not old and new.agent_name != old.agent_name
        n, out = load(client, hashes)
        assert n == 4 and all(np.array_equal(a, b) for a, b in zip(out, blocks))


def arena_inodes() -> set[str]:
    """Inodes of the worker arenas (memfds) mapped into this process now."""
    return {line.split()[4] for line in Path("/proc/self/maps").read_text().splitlines()
            if "memfd:kvstore-arena" in line}


def test_a_dead_workers_arena_is_unmapped_by_the_engines_that_mapped_it(stack):
    gc.collect()
    before = arena_inodes()
    with KVStoreClient(stack.url, NS, staging_bytes=4 * NS.block_nbytes) as client:
        assert save(client, *prompt(4)) == 4 and mapped(client) == {"w0"}
        theirs = arena_inodes() - before
        assert len(theirs) == 1
        stack.kill(stack.worker)  # SIGKILL: the worker says nothing, its end of the socket just closes
        wait_until(lambda: mapped(client) == set(), 10, "the dead worker's arena dropped")
        gc.collect()
        assert not theirs & arena_inodes()  # unmapped: the dead worker's memory is not held by this engine


def test_a_folder_others_could_change_is_not_trusted_and_nixl_carries_the_blocks(stack, arenas):
    arenas.chmod(0o777)  # anyone could have put a socket of their own there
    with KVStoreClient(stack.url, NS, staging_bytes=4 * NS.block_nbytes) as client:
        hashes, blocks = prompt(3)
        assert save(client, hashes, blocks) == 4
        n, out = load(client, hashes)
        assert n == 4 and all(np.array_equal(a, b) for a, b in zip(out, blocks))
        assert mapped(client) == set()


def test_the_paged_path_copies_with_the_arena_and_a_block_bad_there_fails_from_that_block_on(stack):
    """vLLM's path: a layer's pages of every block copied with the mapped arena, each block
    hashed there. A byte of block 2 changed in the arena after the save: the load reports blocks
    2 and 3 for recompute, 0 and 1 arrive intact, and the bad replica is invalidated."""
    ns = Namespace(model_id="paged-same-host", num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16",
                   block_tokens=16, layout="layer_head_token_kvdim")
    directory = DirectoryClient(stack.url)
    namespace_id = directory.register_namespace(ns)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(ns.num_layers)]
    pages = torch.randn((ns.num_layers, 16, 2, 16, 32)).to(torch.bfloat16)  # 16 block ids per layer
    worker = PagedKVWorker(directory, names, (2, 16, 32), torch.bfloat16)
    try:
        worker.register({name: pages[i] for i, name in enumerate(names)})
        hashes = [h.hex() for h in block_hashes(ns, list(range(64)))]
        save_pages(worker, namespace_id, "save", hashes, [0, 1, 2, 3])
        assert directory.lookup(namespace_id, hashes).num_hit_blocks == 4
        assert load_pages(worker, namespace_id, "intact", hashes, [4, 5, 6, 7]) == set()
        assert torch.equal(pages[:, 4:8], pages[:, 0:4])
        assert worker.posts["nixl"] == 0 and worker.posts["local"] == 2 * ns.num_layers  # a save and a load
        location = directory.lookup(namespace_id, hashes, locations=True).blocks[2].location
        arena = worker.arenas._arenas["w0"]
        arena.array[location.runs[0][0] - arena.base_addr + 100] ^= 0xFF
        assert load_pages(worker, namespace_id, "bad", hashes, [8, 9, 10, 11]) == {10, 11}
        assert torch.equal(pages[:, 8:10], pages[:, 0:2])
        assert directory.lookup(namespace_id, hashes).num_hit_blocks == 2  # block 2's replica invalidated
    finally:
        worker.close()


@pytest.fixture
def unverified(tmp_path, arenas):
    """A worker sharing its arena, under a directory that takes the writer's checksum on trust (the default)."""
    with ProcessStack(tmp_path, worker_args=["--arena-dir", str(arenas)]) as s:
        yield s


@contextmanager
def overwritten_after_each_copy(mine: LocalArenas):
    """Every copy numpy makes into this engine's mapping of w0's arena is followed at once by another
    writer's (a stale reservation's, another engine's), through a second mapping of that arena."""
    theirs, real, patch = LocalArenas(), np.copyto, pytest.MonkeyPatch()

    def copyto(destination, source, **kw):
        real(destination, source, **kw)
        arena = mine._arenas.get("w0")
        if arena is None or not np.shares_memory(destination, arena.array):
            return
        other = theirs.view(specs.ReplicaLocation(worker="w0", epoch=arena.epoch, agent_name=arena.agent_name,
                                                  tier="dram", runs=[]))
        low, high = byte_bounds(destination)
        at = low - arena.array.ctypes.data
        other.array[at:at + high - low] = 0x5A

    patch.setattr(np, "copyto", copyto)
    try:
        yield
    finally:
        patch.undo()
        theirs.close()


def test_a_same_host_save_overwritten_in_the_arena_after_its_copies_is_never_loaded_as_verified(unverified):
    """Blocks, tensors (packed) and vLLM's pages: the checksum a save commits is what the engine
    meant to write, so bytes another writer put there after the copies fail the next load."""
    with KVStoreClient(unverified.url, NS, staging_bytes=8 * NS.block_nbytes) as client:
        hashes, blocks = prompt(21)
        with overwritten_after_each_copy(client.copier.arenas):
            assert save(client, hashes, blocks) == 4
        assert mapped(client) == {"w0"} and load(client, hashes)[0] == 0

        tokens = list(range(1000, 1000 + 4 * NS.block_tokens))
        kv = [(torch.randn(NS.num_kv_heads, len(tokens), NS.head_dim), torch.randn(NS.num_kv_heads, len(tokens),
                                                                                    NS.head_dim))
              for _ in range(NS.num_layers)]
        with overwritten_after_each_copy(client.copier.arenas):
            assert client.save(tokens, kv) == len(tokens)
        assert client.load(tokens)[1] == 0

    ns = Namespace(model_id="paged-overwritten", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                   block_tokens=16, layout="layer_head_token_kvdim")
    directory = DirectoryClient(unverified.url)
    namespace_id = directory.register_namespace(ns)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(ns.num_layers)]
    pages = torch.randn((ns.num_layers, 8, 2, 16, 32))
    worker = PagedKVWorker(directory, names, (2, 16, 32), torch.float32)
    try:
        worker.register({name: pages[i] for i, name in enumerate(names)})
        paged = [h.hex() for h in block_hashes(ns, list(range(32)))]
        with overwritten_after_each_copy(worker.arenas):
            save_pages(worker, namespace_id, "save", paged, [0, 1])
        assert worker.posts["local"] == ns.num_layers and directory.lookup(namespace_id, paged).num_hit_blocks == 2
        assert load_pages(worker, namespace_id, "load", paged, [4, 5]) == {4, 5}
    finally:
        worker.close()
