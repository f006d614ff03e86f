"""Worker-pushed loads: a worker process WRITEs leased blocks into an engine's registered memory
over NIXL UCX, under a grant the directory signed; the engine checks every block's checksum. A push
the grant does not cover, one for another engine, or one into memory the engine has released or
registered anew never happens."""

from __future__ import annotations

import base64
import http.client
import json
from urllib.parse import urlsplit

import numpy as np
import pytest

from kvstore.connector import KVStoreClient
from kvstore.core import push, specs
from kvstore.core.errors import KVStoreError
from kvstore.core.memory import HostBuffer
from kvstore.worker.pushes import agent_name
from tests.fault.prompts import NS, prompt, save
from tests.stacks import ProcessStack


@pytest.fixture
def stack(tmp_path):
    with ProcessStack(tmp_path) as s:
        yield s


def post(url: str, path: str, body: dict | str) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", path, body if isinstance(body, str) else json.dumps(body),
                     {"content-type": "application/json"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def saved(client: KVStoreClient, seed: int = 1) -> tuple[list[bytes], list[np.ndarray]]:
    hashes, blocks = prompt(seed)
    assert save(client, hashes, blocks) == len(hashes)
    return hashes, blocks


def request(client: KVStoreClient, hashes: list[bytes], dest: int, **changes) -> tuple[str, dict]:
    """A push of `hashes` (leased now, with a grant) into engine memory at `dest`, as the engine sends
    it: (the worker's control URL, the body)."""
    prepared = client.directory.prepare_load(specs.PrepareLoad(
        namespace_id=client.namespace_id, hashes=[h.hex() for h in hashes], reader=client.agent.name, push=True))
    grant, = prepared.grants
    runs = [run for hit in prepared.blocks for run in hit.location.runs]
    items, at = [], dest
    for i, (_, nbytes) in enumerate(runs):
        items.append((i, at))
        at += nbytes
    body = push.PushRequest(
        tenant=NS.tenant, owner=grant.owner, reader=client.agent.name, epoch=grant.epoch, token=prepared.token,
        expires_at=grant.expires_at, runs=runs, grant=grant.grant, engine_key=grant.engine_key, items=items,
        engine=push.EngineMemory(generation=client.pusher.generation,
                                 metadata=base64.b64encode(client.agent.metadata()).decode()))
    return grant.control_url, {**json.loads(body.model_dump_json()), **changes}


def test_a_load_is_pushed_by_the_worker_and_verified(stack):
    with KVStoreClient(stack.url, NS, same_host="off", load_push="on", staging_bytes=64 * NS.block_nbytes) as client:
        assert agent_name(client.agent.metadata()) == client.agent.name  # what the worker checks metadata by
        hashes, blocks = saved(client)
        views = client._staging_views(len(hashes))
        for view in views:
            view[:] = 0
        assert client.load_blocks(hashes, views) == len(hashes)
        assert all(np.array_equal(v, b) for v, b in zip(views, blocks))
        assert (client.pusher.pushed, client.pusher.read) == (len(hashes), 0)
        # the worker keeps its metadata: the next load sends none and is pushed again
        assert client.load_blocks(hashes, views) == len(hashes) and client.pusher.pushed == 2 * len(hashes)
    with KVStoreClient(stack.url, NS, same_host="off", load_push="off") as reader:
        assert reader.load_blocks(hashes, reader._staging_views(len(hashes))) == len(hashes)
        assert (reader.pusher.pushed, reader.pusher.read) == (0, 0)  # it never asked for grants


def test_a_push_needs_a_grant_for_exactly_those_runs_and_that_engine(stack):
    with KVStoreClient(stack.url, NS, same_host="off", load_push="on") as client:
        hashes, blocks = saved(client)
        target = HostBuffer(len(hashes) * NS.block_nbytes)
        client.register_buffer(target.array)
        url, body = request(client, hashes, target.addr)
        other = [list(r) for r in body["runs"]]
        other[0][0] += 16 << 10  # the next page: another block
        for changed, status in [({"runs": other}, 403), ({"reader": "kvstore-client-someone-else"}, 403),
                                ({"tenant": "another"}, 403), ({"grant": "0" * 64}, 403), ({"owner": "x"}, 403),
                                ({"epoch": body["epoch"] + 1}, 403),
                                ({"items": [[len(body["runs"]), target.addr]]}, 400),
                                ({"items": []}, 400), ({"wait_s": 1e9}, 400)]:
            code, answer = post(url, "/v1/push", {**body, **changed})
            assert code == status, (changed, answer)
        assert not target.array.any()  # nothing was written
        code, answer = post(url, "/v1/push", "{not json")
        assert code == 400 and answer["error"] == "invalid"
        code, answer = post(url, "/v1/push", body)
        assert (code, answer) == (200, {"code": "ok"})
        assert np.array_equal(target.array, np.concatenate([b.reshape(-1).view(np.uint8) for b in blocks]))
        code, _ = post(url, "/v1/push/forget", {"tenant": NS.tenant, "owner": "", "reader": client.agent.name,
                                                "epoch": body["epoch"], "engine_key": "0" * 64, "generation": 99})
        assert code == 403


def test_no_push_lands_in_memory_the_engine_released_or_registered_anew(stack):
    with KVStoreClient(stack.url, NS, same_host="off", load_push="on") as client:
        hashes, blocks = saved(client)
        first = HostBuffer(len(hashes) * NS.block_nbytes)
        client.register_buffer(first.array)
        old_url, old = request(client, hashes, first.addr)  # under the generation that named `first`
        views = [first.array[i * NS.block_nbytes:(i + 1) * NS.block_nbytes] for i in range(len(hashes))]
        assert client.load_blocks(hashes, views) == len(hashes) and client.pusher.read == 0
        first.array[:] = 0
        client.release_buffer(first.array)
        code, answer = post(old_url, "/v1/push", old)  # a push sent before the release, arriving after it
        assert code == 200 and answer["code"] == "stale", answer
        assert not first.array.any()
        second = HostBuffer(len(hashes) * NS.block_nbytes)
        client.register_buffer(second.array)  # memory registered anew: the worker gets the new metadata
        views = [second.array[i * NS.block_nbytes:(i + 1) * NS.block_nbytes] for i in range(len(hashes))]
        assert client.load_blocks(hashes, views) == len(hashes)
        expected = np.concatenate([b.reshape(-1).view(np.uint8) for b in blocks])
        assert client.pusher.read == 0 and np.array_equal(np.concatenate(views), expected)
        assert post(old_url, "/v1/push", old)[1]["code"] == "stale" and not first.array.any()


def test_a_failed_push_is_read_instead(stack):
    """The worker refuses every push (it lost the engine's key with a restart): the load reads."""
    with KVStoreClient(stack.url, NS, same_host="off", load_push="on") as client:
        hashes, blocks = saved(client)
        grant_of = client.pusher.push

        def expired(prepared, items):  # grants that no longer match what was leased
            bad = prepared.model_copy(update={"grants": [g.model_copy(update={"grant": "0" * 64})
                                                         for g in prepared.grants]})
            return grant_of(bad, items)
        client.pusher.push = expired
        views = client._staging_views(len(hashes))
        assert client.load_blocks(hashes, views) == len(hashes)
        assert all(np.array_equal(v, b) for v, b in zip(views, blocks))
        assert (client.pusher.pushed, client.pusher.read, client.pusher.failed) == (0, len(hashes), len(hashes))



def test_versions_from_before_pushed_loads_are_read_from(stack):
    """A directory that refuses the `push` field (as one from before does, a 400), and a worker with no
    push route (a 404): the engine reads, and asks neither again."""
    with KVStoreClient(stack.url, NS, same_host="off", load_push="on") as client:
        hashes, blocks = saved(client)
        prepare, asked = client.directory.prepare_load, []

        def old_directory(body):
            asked.append(body.push)
            if body.push:
                raise KVStoreError("invalid", "request body does not match the schema",
                                   errors=["Object contains unknown field `push`"])
            return prepare(body)
        client.directory.prepare_load = old_directory
        views = client._staging_views(len(hashes))
        assert client.load_blocks(hashes, views) == len(hashes) == client.load_blocks(hashes, views)
        assert asked == [True, False, False] and (client.pusher.pushed, client.pusher.read) == (0, 0)
    with KVStoreClient(stack.url, NS, same_host="off", load_push="on") as client:
        prepare = client.directory.prepare_load

        def old_worker(body):  # its grants name a server without the push route
            prepared = prepare(body)
            return prepared.model_copy(update={"grants": [g.model_copy(update={"control_url": stack.url})
                                                          for g in prepared.grants]})
        client.directory.prepare_load = old_worker
        views = client._staging_views(len(hashes))
        assert client.load_blocks(hashes, views) == len(hashes) == client.load_blocks(hashes, views)
        assert all(np.array_equal(v, b) for v, b in zip(views, blocks))
        # both loads read; only the first tried a push
        assert (client.pusher.pushed, client.pusher.read, client.pusher.failed) == (0, 2 * len(hashes), len(hashes))
