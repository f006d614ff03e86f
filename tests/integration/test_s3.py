"""The S3 tier against a real S3 endpoint (moto_server), moved with NIXL OBJ: DRAM -> NVMe -> S3 under
pressure, promotion back from S3, survival of a SIGKILL, corruption and a missing bucket."""

from __future__ import annotations

import subprocess
from collections import Counter

import httpx
import numpy as np
import pytest

from kvstore.client import DirectoryClient
from kvstore.core.keys import block_hashes
from tests.helpers import MotoServer, kvstore_cmd, wait_until
from tests.stacks import ProcessStack, run_engine, s3_bucket
from tests.integration.engine import BLOCK_TOKENS, PROMPT_TOKENS, build_model, namespace_of, tokens

FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
BLOCKS = FULL // BLOCK_TOKENS


@pytest.fixture
def s3(tmp_path, monkeypatch):
    with s3_bucket(tmp_path, monkeypatch, "kv-cache") as moto:
        yield moto


def s3_stack(tmp_path, s3: MotoServer, prefix: str, memory: list[str], *directory_args: str) -> ProcessStack:
    """A directory and a worker whose tiers end in S3 under `prefix` (not started)."""
    return ProcessStack(tmp_path, worker_memory=[*memory, "--s3-bucket", "kv-cache", "--s3-endpoint", s3.url,
                                                 "--s3-prefix", prefix], directory_args=list(directory_args))


@pytest.fixture
def stack(tmp_path, s3):
    """DRAM of 2 MiB over NVMe of 2 MiB over S3 (16 KiB pages), running."""
    with s3_stack(tmp_path, s3, "test", ["--page-bytes", "16KiB", "--dram-bytes", "2MiB", "--nvme-bytes", "2MiB",
                                         "--nvme-dir", str(tmp_path / "nvme")]) as s:
        yield s


def settle(client: DirectoryClient, timeout_s: float = 60.0) -> None:
    """Wait until no move is in flight and the replicas per tier stopped changing."""
    seen = []

    def quiet() -> bool:
        stats = client.stats()
        seen.append((stats.reservations, stats.replicas_by_tier))
        return len(seen) > 3 and stats.reservations == 0 and seen[-1] == seen[-2] == seen[-3]
    wait_until(quiet, timeout_s, "no moves in flight")


def warnings(*logs) -> list[str]:
    return [line for log in logs for line in log.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line or "Error" in line][-30:]


def where(client: DirectoryClient, seed: int) -> dict:
    ns = namespace_of(build_model())
    hashes = [h.hex() for h in block_hashes(ns, tokens(PROMPT_TOKENS, seed=seed))]
    found = client.lookup(ns.namespace_id, hashes)
    assert Counter(found.tiers()) == found.by_tier and len(found.tiers()) == found.num_hit_blocks
    located = client.lookup(ns.namespace_id, hashes, locations=True)  # blocks may move in between
    assert located.tiers() == [b.location.tier for b in located.blocks]
    return found.by_tier


def test_blocks_cascade_to_s3_and_come_back_even_after_a_kill(tmp_path, s3, stack):
    url, client = stack.url, stack.client
    for seed in (1, 2, 3, 4):
        assert run_engine(url, "save", tmp_path, seed)["stored_tokens"] == FULL
    wait_until(lambda: where(client, 1).get("s3", 0) > 0, 60, "oldest prompt partly in S3")
    assert sum(where(client, 1).values()) == BLOCKS and "dram" not in where(client, 1)
    objects = s3.client().list_objects_v2(Bucket="kv-cache", Prefix="test/")["Contents"]
    ns_id = namespace_of(build_model()).namespace_id
    assert objects and all(o["Key"].startswith(f"test/{ns_id}/") for o in objects)

    loaded = run_engine(url, "load", tmp_path, 1)  # staged from S3 into DRAM, then read over UCX
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded

    stack.kill_all()
    stack.start_directory()
    assert stack.start_worker() == 2
    client = stack.client
    in_s3 = where(client, 1).get("s3", 0)
    assert in_s3 > 0 and "dram" not in where(client, 1)
    loaded = run_engine(url, "load", tmp_path, 1)
    assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded
    stats = client.stats()
    assert (stats.pins, stats.leases_active, stats.reservations) == (0, 0, 0)


def test_a_corrupted_object_shortens_the_load(tmp_path, s3, stack):
    url, client = stack.url, stack.client
    for seed in (1, 2, 3, 4):
        run_engine(url, "save", tmp_path, seed)
    wait_until(lambda: where(client, 1).get("s3", 0) > 0, 60, "oldest prompt partly in S3")
    ns = namespace_of(build_model())
    hashes = [h.hex() for h in block_hashes(ns, tokens(PROMPT_TOKENS, seed=1))]
    hits = client.lookup(ns.namespace_id, hashes, locations=True).blocks
    index = next(i for i, hit in enumerate(hits) if hit.location.tier == "s3")
    key = f"test/{ns.namespace_id}/{hashes[index]}"
    body = bytearray(s3.client().get_object(Bucket="kv-cache", Key=key)["Body"].read())
    body[123] ^= 0xFF
    s3.client().put_object(Bucket="kv-cache", Key=key, Body=bytes(body))

    loaded = run_engine(url, "load", tmp_path, 1)
    assert loaded["loaded_tokens"] == index * BLOCK_TOKENS and loaded["max_abs_diff"] <= 1e-4, loaded
    assert "kvstore_checksum_failures_total 1.0" in httpx.get(url + "/metrics").text


def test_a_missing_bucket_is_one_clear_error(tmp_path, s3):
    result = subprocess.run(kvstore_cmd("worker", "serve", "--directory-url", "http://127.0.0.1:9",
                                        "--s3-bucket", "no-such-bucket", "--s3-endpoint", s3.url),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "S3 bucket 'no-such-bucket' is not usable" in result.stderr and "Traceback" not in result.stderr


def test_write_through_keeps_a_namespace_durable_without_pressure(tmp_path, s3):
    with s3_stack(tmp_path, s3, "wt", ["--dram-bytes", "64MiB"]) as stack:
        url, client = stack.url, stack.client
        ns = namespace_of(build_model())
        client.register_namespace(ns)
        on = subprocess.run(kvstore_cmd("write-through", ns.namespace_id, "--url", url), capture_output=True,
                            text=True, timeout=60)
        assert on.returncode == 0 and "write-through on" in on.stdout
        assert run_engine(url, "save", tmp_path, 1)["stored_tokens"] == FULL
        listed = lambda: s3.client().list_objects_v2(Bucket="kv-cache", Prefix="wt/").get("KeyCount", 0)  # noqa: E731
        wait_until(lambda: listed() == BLOCKS, 60, "every block copied to S3")
        assert where(client, 1) == {"dram": BLOCKS}  # DRAM stays the copy readers get
        stack.kill_all()
        stack.start_directory()
        assert stack.start_worker() == 2  # DRAM is gone with the worker; the S3 copies are not
        client = stack.client
        assert where(client, 1) == {"s3": BLOCKS}
        loaded = run_engine(url, "load", tmp_path, 1)
        assert loaded["loaded_tokens"] == FULL and loaded["max_abs_diff"] <= 1e-4, loaded


def test_prompts_the_size_of_dram_and_larger_are_stored_whole_and_load_whole(tmp_path, s3):
    """DRAM about one prompt in size (4 MiB), NVMe 16 MiB, S3 below, admission `always`, the
    worker's default page size: 20 prompts of 32 blocks of 72 KiB, then one of 80 blocks (5.6 MiB,
    more than DRAM holds), are each stored whole (room is made for all of it, round by round) and
    each loads whole and exact from wherever it went (DRAM, NVMe or S3, staged into a full DRAM
    tier), before and after both processes are killed and started again. (With 64 KiB pages a 72 KiB block took 128 KiB and
    every prompt after the first was stored with 23 to 28 of its 32 blocks, saying nothing.)"""
    from kvstore.connector import KVStoreClient
    from kvstore.core.keys import Namespace

    ns = Namespace(model_id="dram-sized-prompts", num_layers=9, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                   block_tokens=16)
    assert ns.block_nbytes == 72 << 10
    sizes = [32] * 20 + [80]
    rng = np.random.default_rng(5)
    memory = [rng.integers(0, 256, (n, ns.block_nbytes), np.uint8) for n in sizes]
    hashes = [block_hashes(ns, np.random.default_rng([6, k]).integers(0, 30_000, n * 16)) for k, n in enumerate(sizes)]
    out = np.zeros((max(sizes), ns.block_nbytes), np.uint8)
    with s3_stack(tmp_path, s3, "dram-sized", ["--dram-bytes", "4MiB", "--nvme-bytes", "16MiB", "--nvme-dir",
                                               str(tmp_path / "nvme")], "--admission", "always") as stack:
        for restarted in (False, True):
            if restarted:  # both processes lost, then started again on their files
                stack.kill_all()
                stack.start_directory()
                stack.start_worker()
            with KVStoreClient(stack.url, ns, staging_bytes=ns.block_nbytes) as client:
                for block in memory:
                    client.register_buffer(block)
                client.register_buffer(out)
                if not restarted:
                    stored = [client.save_blocks(hashes[k], list(memory[k])) for k in range(len(sizes))]
                    assert stored == sizes, client.last_refused
                    assert stack.client.stats().replicas_by_tier.get("s3", 0) > 0  # 45 MiB in 4 + 16 MiB
                for k, n in enumerate(sizes):
                    out[:] = 0
                    loaded = client.load_blocks(hashes[k], list(out[:n]))
                    assert loaded == n and np.array_equal(out[:n], memory[k]), (restarted, k, loaded)
