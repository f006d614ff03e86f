"""The JSON client's keep-alive connections: reuse, a connection the server closed while idle, errors."""

from __future__ import annotations

import json
import socket
import socketserver
import threading

import pytest

from kvstore.client.http import JsonHttp
from kvstore.core.errors import KVStoreError


class ScriptedServer(socketserver.ThreadingTCPServer):
    """Answers each request by `script(n)` (n counts requests): "ok", "error", "close-after"
    (answer, then close the connection without saying so) or "drop" (close without answering)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, script) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.requests, self.connections = script, [], 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.server.connections += 1
        while True:
            line = self.rfile.readline()
            if not line:
                return
            headers = {}
            while (header := self.rfile.readline().strip()):
                name, _, value = header.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", 0)))
            self.server.requests.append((line.decode().split()[1], headers, body))
            action = self.server.script(len(self.server.requests))
            if action == "drop":
                return
            status, payload = (200, {"echo": json.loads(body or b"null")}) if action != "error" else (
                409, {"error": "conflict", "detail": "already there", "context": {"hash": "ab"}})
            data = json.dumps(payload).encode()
            self.wfile.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: "
                             f"{len(data)}\r\n\r\n".encode() + data)
            if action == "close-after":
                self.connection.shutdown(socket.SHUT_RDWR)
                return


@pytest.fixture
def serve():
    servers = []

    def start(script):
        servers.append(ScriptedServer(script))
        return servers[-1]
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_calls_reuse_one_connection_and_send_the_token(serve):
    server = serve(lambda n: "ok")
    client = JsonHttp(server.url, token="secret")
    for i in range(5):
        assert client.call_raw("POST", "/v1/x", {"i": i}) == {"echo": {"i": i}}
    assert server.connections == 1
    assert all(h["authorization"] == "Bearer secret" for _, h, _ in server.requests)
    client.close()


def test_a_connection_the_server_closed_while_idle_is_replaced(serve):
    server = serve(lambda n: "close-after")
    client = JsonHttp(server.url)
    assert [client.call_raw("POST", "/v1/x", {"i": i})["echo"]["i"] for i in range(3)] == [0, 1, 2]
    assert server.connections == 3 and len(server.requests) == 3  # each request sent once


def test_a_reused_connection_dropped_mid_request_is_retried_once(serve):
    server = serve(lambda n: "drop" if n == 2 else "ok")
    client = JsonHttp(server.url)
    client.call_raw("POST", "/v1/x", {"i": 0})
    assert client.call_raw("POST", "/v1/x", {"i": 1}) == {"echo": {"i": 1}}
    assert len(server.requests) == 3 and server.connections == 2


def test_a_new_connection_dropped_is_unavailable_without_a_retry(serve):
    server = serve(lambda n: "drop")
    with pytest.raises(KVStoreError) as info:
        JsonHttp(server.url, timeout_s=5).call_raw("POST", "/v1/x", {"i": 0})
    assert info.value.kind == "unavailable" and len(server.requests) == 1


def test_error_bodies_become_kvstore_errors(serve):
    server = serve(lambda n: "error")
    with pytest.raises(KVStoreError) as info:
        JsonHttp(server.url).call_raw("POST", "/v1/x", {"i": 0})
    assert info.value.kind == "conflict" and info.value.context == {"hash": "ab"}


def test_unreachable_and_malformed_urls():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(KVStoreError) as info:
            JsonHttp(f"http://127.0.0.1:{port}", timeout_s=2).call_raw("GET", "/healthz")
    assert info.value.kind == "unavailable"
    with pytest.raises(KVStoreError) as info:
        JsonHttp("127.0.0.1:8000")
    assert info.value.kind == "invalid"
