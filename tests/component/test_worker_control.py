"""The worker's control endpoint under bad input: every request answered with an error body, bounded."""

from __future__ import annotations

import json
import os
import socket
import time
from types import SimpleNamespace

import pytest

from kvstore.core import moving, page_calls, specs
from kvstore.core.keys import MAX_BLOCK_BYTES
from kvstore.core.pages import PageAllocator
from kvstore.worker.control import MAX_BODY, ControlServer
from kvstore.worker.nvme import MANIFEST, NvmeTier
from tests.helpers import raw_request


@pytest.fixture
def control():
    def broken_mover(_req):
        raise RuntimeError("a bug")
    server = ControlServer({"dram": PageAllocator(8, 128)}, mover=broken_mover, max_connections=4)
    server.start()
    yield server
    server.stop()


def post(path: str, length: str) -> str:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n"


def test_bad_lengths_and_bodies_get_error_bodies(control):
    assert raw_request(control, post("/v1/alloc", "abc"))[1]["error"] == "invalid"
    assert raw_request(control, post("/v1/alloc", "-5"))[1]["error"] == "invalid"
    status, body = raw_request(control, post("/v1/alloc", str(MAX_BODY + 1)))
    assert (status, body["error"]) == (413, "too_large")
    status, body = raw_request(control, post("/v1/alloc", "7"), b"{nope}}")
    assert (status, body["error"]) == (400, "invalid")
    status, body = raw_request(control, post("/v1/nowhere", "2"), b"{}")
    assert (status, body["error"]) == (404, "not_found")
    for bad in ({"token": "t" * 65, "kind": "dram", "sizes": [128]},
                {"token": "", "kind": "dram", "sizes": [128]},
                {"token": "t", "kind": "dram", "sizes": [MAX_BLOCK_BYTES + 1]},
                {"token": "t", "kind": "dram", "sizes": [0]}):
        body_bytes = json.dumps(bad).encode()
        status, body = raw_request(control, post("/v1/alloc", str(len(body_bytes))), body_bytes)
        assert (status, body["error"]) == (400, "invalid"), bad
    too_many = {"items": [{"token": "t", "runs": []}] * (page_calls.MAX_FREE_ITEMS + 1)}
    for path, bad in (("/v1/grant", {"token": "t", "kind": "dram", "max_pages": page_calls.MAX_GRANT_PAGES + 1}),
                      ("/v1/free", too_many)):
        body_bytes = json.dumps(bad).encode()
        status, body = raw_request(control, post(path, str(len(body_bytes))), body_bytes)
        assert (status, body["error"]) == (400, "invalid"), path


def test_a_bug_is_answered_not_a_dropped_connection(control):
    body = moving.MoveRequest(items=[moving.MoveItem(
        src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="nvme", dst_runs=[], dst_token="t",
        nbytes=128, checksum="0123456789abcdef", namespace_id="0" * 16, hash="ab")]).model_dump_json().encode()
    status, answer = raw_request(control, post("/v1/move", str(len(body))), body)
    assert (status, answer["error"], answer["detail"]) == (500, "internal", "RuntimeError")
    status, answer = raw_request(control, "GET /healthz HTTP/1.1\r\nhost: x\r\n")
    assert (status, answer) == (200, {"status": "ok"})  # still serving


def test_connections_beyond_the_limit_wait_for_a_slot(control):
    idle = [socket.create_connection((control.host, control.port)) for _ in range(4)]
    time.sleep(0.2)  # all four accepted: every slot taken by an idle connection
    with pytest.raises(TimeoutError):
        raw_request(control, "GET /healthz HTTP/1.1\r\nhost: x\r\n", timeout_s=1)
    idle.pop().close()
    assert raw_request(control, "GET /healthz HTTP/1.1\r\nhost: x\r\n")[0] == 200
    for sock in idle:
        sock.close()


def test_only_the_holder_of_the_workers_secret_is_served():
    from kvstore.client.worker import WorkerControlClient
    from kvstore.core.errors import KVStoreError

    secret = "s" * 43
    server = ControlServer({"dram": PageAllocator(8, 128)}, secret=secret)
    server.start()
    try:
        body = page_calls.AllocRequest(token="t", kind="dram", sizes=[128])
        for forged in (None, "s" * 42, secret + "x", "Basic " + secret):
            client = WorkerControlClient(server.url, timeout_s=5, token=forged)
            with pytest.raises(KVStoreError) as refused:
                client.allocate(body)
            assert refused.value.kind == "unauthorized"
            client.close()
        assert server.allocators["dram"].free_pages == 8  # nothing was allocated by a forged call
        status, answer = raw_request(server, "POST /v1/free HTTP/1.1\r\nauthorization: Bearer nope\r\n"
                                 "content-length: 2\r\n", b"{}")
        assert status == 401 and answer["error"] == "unauthorized"
        real = WorkerControlClient(server.url, timeout_s=5, token=secret)
        assert len(real.allocate(body).runs) == 1
        real.close()
        status, _ = raw_request(server, "GET /healthz HTTP/1.1\r\n")
        assert status == 200
    finally:
        server.stop()


def test_metrics_are_served_only_when_open_or_to_the_metrics_token():
    import httpx

    secret, scrape = "s" * 43, "m" * 32
    closed = ControlServer({"dram": PageAllocator(8, 128)}, secret=secret, metrics_token=scrape)
    opened = ControlServer({"dram": PageAllocator(8, 128)}, secret=secret, open_metrics=True)
    for server in (closed, opened):
        server.start()
    try:
        for header in ({}, {"authorization": "Bearer " + "m" * 31}, {"authorization": scrape}):
            answer = httpx.get(closed.url + "/metrics", headers=header)
            assert answer.status_code == 401 and answer.json()["error"] == "unauthorized", header
        closed.allocators["dram"].allocate("t", 3 * 128)
        for header in ({"authorization": f"Bearer {scrape}"}, {"authorization": f"Bearer {secret}"}):
            answer = httpx.get(closed.url + "/metrics", headers=header)
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
            assert 'kvstore_worker_tier_held_bytes{tier="dram"} 384.0' in answer.text
            assert 'kvstore_worker_tier_capacity_bytes{tier="dram"} 1024.0' in answer.text
        text = httpx.get(closed.url + "/metrics", headers={"authorization": f"Bearer {scrape}"}).text
        assert 'kvstore_worker_control_requests_total{path="/metrics",status="401"} 3.0' in text
        assert httpx.get(opened.url + "/metrics").status_code == 200  # no credential needed
    finally:
        for server in (closed, opened):
            server.stop()


def test_a_worker_bound_to_every_address_advertises_the_one_it_is_told():
    import httpx
    from pydantic import ValidationError

    from kvstore.worker.settings import WorkerSettings

    server = ControlServer({"dram": PageAllocator(8, 128)}, host="0.0.0.0", advertise="127.0.0.1")
    server.start()
    try:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    finally:
        server.stop()
    assert ControlServer({}, host="::1", port=0, advertise=None).url.startswith("http://[::1]:")
    with pytest.raises(ValidationError, match="advertise_host"):
        WorkerSettings(host="0.0.0.0")
    assert WorkerSettings(host="0.0.0.0", advertise_host="10.0.0.7").advertise_host == "10.0.0.7"


def _move(token: str) -> moving.MoveRequest:
    return moving.MoveRequest(items=[moving.MoveItem(
        src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="nvme", dst_runs=[], dst_token=token,
        nbytes=128, checksum="0123456789abcdef", namespace_id="0" * 16, hash="ab")])


def test_a_fence_settles_a_move_only_once_nothing_writes_under_it_and_then_refuses_it():
    import threading

    from kvstore.client.worker import WorkerControlClient
    from kvstore.core.errors import KVStoreError

    release, started, calls = threading.Event(), threading.Event(), []

    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        calls.append(req.items[0].dst_token)
        started.set()
        release.wait(10)
        if req.items[0].dst_token == "stuck":  # a NIXL request that timed out while posted
            server.fence.stuck({"stuck"}, SimpleNamespace(settled=lambda: False))
        return moving.MoveResult(ok=[True], errors=[None], codes=["ok"])

    secret = "s" * 43
    server = ControlServer({"dram": PageAllocator(8, 128)}, mover=mover, secret=secret)
    server.start()
    client = WorkerControlClient(server.url, timeout_s=10, token=secret)
    fence = lambda *tokens: client.fence(moving.FenceRequest(tokens=list(tokens))).settled  # noqa: E731
    try:
        running = threading.Thread(target=lambda: client.move(_move("busy")))
        running.start()
        started.wait(10)
        other = WorkerControlClient(server.url, timeout_s=10, token=secret)
        assert other.fence(moving.FenceRequest(tokens=["busy", "never-sent"])).settled == [False, True]
        release.set()
        running.join(10)
        assert fence("busy") == [True]  # it answered: nothing writes under it any more
        late = client.move(_move("never-sent"))  # a move the dead leader sent, arriving after the fence
        assert late.codes == ["expired"] and "never-sent" not in calls
        assert client.move(_move("stuck")).ok == [True]
        assert fence("stuck") == [False]  # its NIXL request may still write: only the deadline settles it
        with pytest.raises(KVStoreError) as refused:
            WorkerControlClient(server.url, timeout_s=5, token="s" * 42).fence(moving.FenceRequest(tokens=["a"]))
        assert refused.value.kind == "unauthorized"
        for bad in (b'{"tokens": []}', b'{"tokens": ["' + b"x" * 65 + b'"]}', b'{"tokens": [""]}', b"{}"):
            status, answer = raw_request(server, post("/v1/fence", str(len(bad))) + f"authorization: Bearer {secret}\r\n",
                                     bad)
            assert (status, answer["error"]) == (400, "invalid"), bad
        other.close()
    finally:
        release.set()
        client.close()
        server.stop()


def test_a_new_epoch_frees_every_memory_tier_and_keeps_nvme():
    """A worker that joins again in the same process: DRAM and HBM pages granted or allocated under
    the old epoch are free for the directory's new grant (before, HBM kept its old grant and every
    save to a single-HBM-worker host was refused no_space); NVMe keeps what survives restarts."""
    server = ControlServer({"dram": PageAllocator(8, 128), "hbm": PageAllocator(8, 128), "nvme": PageAllocator(8, 128)})
    for kind in ("dram", "hbm"):
        assert server.grant(page_calls.GrantRequest(token="g", kind=kind, max_pages=8)).runs
    server.allocate(page_calls.AllocRequest(token="t", kind="nvme", sizes=[256]))
    server.new_epoch()
    assert [server.allocators[k].free_pages for k in ("dram", "hbm", "nvme")] == [8, 8, 6]
    assert server.grant(page_calls.GrantRequest(token="g2", kind="hbm", max_pages=8)).runs == [
        specs.PageRun(first=0, count=8)]


def _placed(token: str, nbytes: int = 4096, **fields) -> moving.MoveItem:
    """A move item whose NVMe pages the worker is asked to place."""
    values = dict(src_kind="dram", src_runs=[specs.PageRun(first=0, count=1)], dst_kind="nvme", dst_runs=[],
                  dst_token=token, nbytes=nbytes, checksum="0123456789abcdef", namespace_id="0" * 16, hash="ab",
                  allocate=True)
    return moving.MoveItem(**{**values, **fields})


def test_the_worker_places_pages_names_them_and_fails_only_what_does_not_fit():
    from kvstore.client.worker import WorkerControlClient

    seen: list[moving.MoveRequest] = []

    def mover(req: moving.MoveRequest) -> moving.MoveResult:
        seen.append(req)
        n = len(req.items)
        return moving.MoveResult(ok=[True] * n, errors=[None] * n, codes=["ok"] * n)

    nvme = PageAllocator(5, 4096)
    server = ControlServer({"dram": PageAllocator(8, 4096), "nvme": nvme}, mover=mover, secret="s" * 43)
    server.start()
    client = WorkerControlClient(server.url, timeout_s=10, token="s" * 43)
    try:
        answer = client.move(moving.MoveRequest(items=[_placed("m1", 2 * 4096), _placed("m1", 4 * 4096),
                                                       _placed("m1", 4096)]))
        assert answer.ok == [True, False, True] and answer.codes == ["ok", "failed", "ok"]
        assert answer.dst_runs[1] is None and "no free NVMe pages" in answer.errors[1]
        assert [sum(p.count for p in r or []) for r in answer.dst_runs] == [2, 0, 1]
        assert [i.dst_runs for i in seen[0].items] == [answer.dst_runs[0], answer.dst_runs[2]]  # only what fit
        assert not any(i.allocate for i in seen[0].items)
        assert nvme.owns("m1", answer.dst_runs[0] + answer.dst_runs[2]) and nvme.free_pages == 2
        plain = client.move(moving.MoveRequest(items=[_placed("m2", allocate=False, dst_runs=[])]))
        assert plain.dst_runs == []  # nothing placed, nothing named
        client.free(page_calls.FreeRequest(items=[page_calls.FreeItem(token="m1", runs=[], all_pages=True)]))
        assert nvme.free_pages == 5 and nvme.owned_tokens() == set()
        late = client.move(moving.MoveRequest(items=[_placed("m1", 4096)]))  # given back: a late move is refused
        assert late.codes == ["expired"] and nvme.free_pages == 5 and len(seen) == 2
        bad = b'{"items": [{"token": "m1", "runs": [{"first": 0, "count": 1}], "all_pages": true}]}'
        head = post("/v1/free", str(len(bad))) + f"authorization: Bearer {'s' * 43}\r\n"
        status, body = raw_request(server, head, bad)
        assert (status, body["error"]) == (400, "invalid")
    finally:
        client.close()
        server.stop()


def test_an_answer_the_directory_cannot_read_is_no_answer():
    """A move whose answer does not parse (a worker of another version) has an unknown outcome: its
    destinations stay reserved until the worker says it stopped, as when no answer came."""
    import http.server
    import threading

    from kvstore.directory.workers.calls import WorkerCalls

    class Odd(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"ok": [true], "errors": [null], "codes": ["ok"], "unknown": 1}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    calls = WorkerCalls(move_timeout_s=5)
    try:
        answer = calls.move(f"http://127.0.0.1:{server.server_port}", _move("t").items, time.time() + 5)
        assert answer.codes == ["unreachable"] and answer.ok == [False]
    finally:
        calls.close()
        server.shutdown()


def test_engines_hold_a_few_slots_at_most_and_cannot_push_without_a_grant(monkeypatch):
    """Engine calls (no bearer secret) past MAX_ENGINE_CALLS are a 503 at once, before their bodies are
    read, so stalled or slow ones never hold the connections the directory's calls need; a body over
    PUSH_BODY is a 413; a push without a signature of this worker's secret is a 403."""
    from kvstore.core import push
    from kvstore.core.memory import HostBuffer
    from kvstore.worker import control as control_module
    from kvstore.worker.pushes import Pushes

    monkeypatch.setattr(control_module, "ENGINE_READ_TIMEOUT_S", 1.0)
    arena = HostBuffer(1 << 16)
    pushes = Pushes(None, arena, lambda: ("w0", 1, "s" * 43))  # no NIXL agent: nothing may get that far
    server = ControlServer({"dram": PageAllocator(8, 128)}, max_connections=control_module.MAX_ENGINE_CALLS + 4,
                           secret="s" * 43, pushes=pushes)
    server.start()
    try:
        stalled = [socket.create_connection((server.host, server.port)) for _ in range(control_module.MAX_ENGINE_CALLS)]
        for sock in stalled:  # headers that promise a body that comes a byte at a time, then never
            sock.sendall(post("/v1/push", "100").encode() + b"\r\n{")
        time.sleep(0.3)
        status, answer = raw_request(server, post("/v1/push/forget", "2"), b"{}")
        assert (status, answer["error"]) == (503, "unavailable")
        time.sleep(control_module.ENGINE_READ_TIMEOUT_S + 0.5)  # a body must arrive whole within it
        status, answer = raw_request(server, post("/v1/push/forget", "2"), b"{}")
        assert (status, answer["error"]) == (400, "invalid")  # a slot again: only the body is wrong
        body = moving.FenceRequest(tokens=["t"]).model_dump_json().encode()
        head = post("/v1/fence", str(len(body))) + f"authorization: Bearer {'s' * 43}\r\n"
        assert raw_request(server, head, body)[0] == 200  # the directory's call is served meanwhile
        for sock in stalled:
            sock.close()
        time.sleep(0.3)
        status, answer = raw_request(server, post("/v1/push", str(control_module.PUSH_BODY + 1)))
        assert (status, answer["error"]) == (413, "too_large")
        status, answer = raw_request(server, post("/v1/push", "2"), b"{}")
        assert (status, answer["error"]) == (400, "invalid")
        huge = (b'{"tenant": "", "owner": "", "reader": "r", "epoch": ' + b"9" * 5000 + b', "engine_key": "'
                + b"0" * 64 + b'", "generation": 1}')
        status, answer = raw_request(server, post("/v1/push/forget", str(len(huge))), huge)
        assert (status, answer["error"]) == (400, "invalid")  # not a 500 from a number past what is checked
        runs = [(arena.addr, 4096)]
        forged = push.PushRequest(tenant="", owner="", reader="kvstore-client-x", epoch=1, token="t", expires_at=4e9,
                                  runs=runs, grant="0" * 64, engine_key=push.engine_key("guess", "w0", 1, "", "",
                                                                                        "kvstore-client-x"),
                                  engine=push.EngineMemory(generation=1), items=[(0, 1 << 30)])
        body = forged.model_dump_json().encode()
        status, answer = raw_request(server, post("/v1/push", str(len(body))), body)
        assert (status, answer["error"]) == (403, "forbidden")
    finally:
        server.stop()


def test_a_free_request_of_many_nvme_blocks_writes_their_lines_in_one_manifest_sync(tmp_path, monkeypatch):
    """The control endpoint gives the pages of a whole free request back, then writes their "free"
    lines in one sync: a sync per block made a free of 256 NVMe blocks 256 syncs. A free of memory
    pages alone syncs nothing."""
    page = 4096
    tier, pages, dram = NvmeTier(tmp_path, 16 * page, page), PageAllocator(16, page), PageAllocator(4, page)
    server = ControlServer({"dram": dram, "nvme": pages}, on_free=lambda kind, token, runs: tier.forget(token, runs),
                           after_free=tier.sync)
    placed = {f"t{k}": pages.allocate(f"t{k}", page) for k in range(8)}
    for token, runs in placed.items():
        tier.record(_placed(token, page, dst_runs=runs, allocate=False))
    tier.sync()
    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd)))
    freed = server.free(page_calls.FreeRequest(items=[page_calls.FreeItem(token=token, runs=runs)
                                                      for token, runs in placed.items()]))
    assert freed == 8 and pages.free_pages == 16 and synced == [tier._manifest]
    lines = [json.loads(line)["op"] for line in (tmp_path / MANIFEST).read_text().splitlines()]
    assert lines == ["meta"] + ["put"] * 8 + ["free"] * 8
    tier.record(_placed("t9", page, dst_runs=pages.allocate("t9", page), allocate=False))  # a move's, not synced
    in_dram = dram.allocate("d", page)
    assert server.free(page_calls.FreeRequest(items=[page_calls.FreeItem(token="d", runs=in_dram)])) == 1
    assert synced == [tier._manifest]  # a free of memory pages syncs nothing
    tier.close()
    assert NvmeTier(tmp_path, 16 * page, page).survivors() == []  # t9's line was never written
