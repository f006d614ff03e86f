"""Across hosts: a directory, two workers and two engines, each in a network namespace of its own
(its own address, its own arena folder), UCX over TCP between them. Saves, loads (pushed by the
workers), a prefill/decode hand-off and a worker host lost, with the reference model computing over
what was loaded.

    198.18.0.1 dir    directory (SQLite)
    198.18.0.2 w1     worker          198.18.0.3 w2     worker
    198.18.0.4 e1     engine (saves, prefills)
    198.18.0.5 e2     engine (loads, decodes), its link shaped to 1 Gbit/s
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from kvstore.client import DirectoryClient
from kvstore.core.inspection import InspectRequest
from kvstore.core.keys import block_hashes
from kvstore.core.specs import NamespacePolicy
from tests.helpers import kvstore_cmd, wait_http, wait_until
from tests.netns import Hosts

pytestmark = pytest.mark.timeout(600)
TCP = {"UCX_TLS": "tcp"}  # shared memory would cross the namespaces: the hosts talk over the network only
PORT = 8700


@pytest.fixture
def hosts(tmp_path):
    with Hosts(tmp_path, ["dir", "w1", "w2", "e1", "e2"]) as h:
        url = f"http://{h.addr('dir')}:{PORT}"
        directory = h.spawn("dir", kvstore_cmd("directory", "serve", "--insecure-no-auth", "--host", h.addr("dir"),
                                               "--port", str(PORT), "--data-dir", str(h.folder("dir") / "var")),
                            tmp_path / "directory.log")
        wait_http(url + "/readyz?workers=0", proc=directory)
        h.workers = {}
        for name in ("w1", "w2"):
            h.workers[name] = h.spawn(name, kvstore_cmd(
                "worker", "serve", "--directory-url", url, "--name", name, "--host", h.addr(name),
                "--dram-bytes", "64MiB", "--page-bytes", "16KiB", "--arena-dir", str(h.folder(name) / "arenas")),
                tmp_path / f"worker-{name}.log", TCP)
        h.url, h.client = url, DirectoryClient(url)
        wait_until(lambda: sorted(w.name for w in h.client.workers() if w.state == "active") == ["w1", "w2"], 60,
                   "both workers active")
        h.shape("e2", "1gbit")
        yield h


def engine(hosts: Hosts, host: str, mode: str, tmp: Path, *args: str, wait: bool = True):
    """The reference engine (tests/integration/engine.py) on `host`; its JSON result, or its process."""
    out, log = tmp / f"{mode}-{host}.json", tmp / f"engine-{mode}-{host}.log"
    proc = hosts.spawn(host, [*kvstore_cmd()[:1], "-m", "tests.integration.engine", mode, "--url", hosts.url,
                              "--out", str(out), *args], log, TCP)
    if not wait:
        return proc, out, log
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    return json.loads(out.read_text())


def holders(hosts: Hosts) -> list[set[str]]:
    """Per block of the engines' prompt, the workers holding it (READY)."""
    from tests.integration.engine import PROMPT_TOKENS, build_model, namespace_of, tokens

    namespace = namespace_of(build_model())
    hashes = [h.hex() for h in block_hashes(namespace, tokens(PROMPT_TOKENS, seed=1))]
    result = hosts.client.inspect(InspectRequest(namespace_id=namespace.namespace_id, hashes=hashes))
    return [{r.worker for r in b.replicas if r.state == "ready"} for b in result.blocks]


def test_a_prefix_saved_on_one_host_loads_exact_on_another_over_tcp(hosts, tmp_path):
    from tests.integration.engine import build_model, namespace_of

    saved = engine(hosts, "e1", "save", tmp_path)
    assert saved["stored_tokens"] == 1040
    before = hosts.bytes_to("e2")
    loaded = engine(hosts, "e2", "load", tmp_path)
    assert hosts.bytes_to("e2") - before >= 65 * namespace_of(build_model()).block_nbytes  # the KV crossed the link
    assert loaded["loaded_tokens"] == loaded["hit_tokens"] == 1040
    assert loaded["max_abs_diff"] <= 1e-4 and loaded["perturbed_kv_diff"] > 1e-3, loaded
    # no RDMA device, workers on other hosts: every block was pushed by its worker, none read
    assert (loaded["pushed_blocks"], loaded["read_blocks"]) == (65, 0), loaded
    assert all(held and held <= {"w1", "w2"} for held in holders(hosts))
    for host in ("e1", "e2"):  # no engine mapped a worker's arena: every byte crossed the network
        assert not list((hosts.folder(host) / "arenas").glob("*.sock"))


def test_a_prefill_on_one_host_hands_its_kv_to_a_decode_waiting_on_another(hosts, tmp_path):
    waiting = tmp_path / "decode-waiting"
    decode, out, log = engine(hosts, "e2", "decode", tmp_path, "--handoff", "req-7", "--timeout-s", "120",
                              "--waiting", str(waiting), wait=False)
    prefill = engine(hosts, "e1", "prefill", tmp_path, "--handoff", "req-7", "--after", str(waiting))
    assert decode.wait(timeout=300) == 0, log.read_text()[-3000:]
    d = json.loads(out.read_text())
    # "present": every block the decode named was stored before the hand-off's own commit reached it,
    # which ends a wait as well (the save and the hand-off are two commits); never "pending"
    assert prefill["stored_tokens"] == 1040 and d["outcome"] in ("committed", "present"), d
    assert d["loaded_tokens"] == 1039 and d["first_logits_diff"] <= 1e-4, d
    assert d["generated"] == d["reference"] and d["generated"][0] == prefill["first_token"]


def test_a_worker_host_lost_after_its_blocks_were_copied_loses_no_prefix(hosts, tmp_path):
    from tests.integration.engine import build_model, namespace_of

    namespace_id = namespace_of(build_model()).namespace_id
    assert engine(hosts, "e1", "save", tmp_path)["stored_tokens"] == 1040
    assert hosts.client.set_policy(namespace_id, NamespacePolicy(replicas=2)).replicas == 2
    wait_until(lambda: all(held == {"w1", "w2"} for held in holders(hosts)), 120,
               "every block copied to the other worker's host (worker to worker, over TCP)")
    hosts.workers["w1"].send_signal(signal.SIGKILL)  # the host is gone: its DRAM with it
    hosts.workers["w1"].wait()
    # until the directory declares it dead (its heartbeat timeout) it may still hand out w1's copies,
    # whose reads fail: a miss, never wrong bytes; from then on every block is read from w2
    wait_until(lambda: hosts.client.worker("w1").state == "dead", 60, "w1 declared dead")
    loaded = engine(hosts, "e2", "load", tmp_path)
    assert loaded["loaded_tokens"] == 1040 and loaded["max_abs_diff"] <= 1e-4, loaded
