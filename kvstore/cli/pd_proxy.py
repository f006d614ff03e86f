"""`kvstore pd-proxy`: an OpenAI-compatible router for prefill/decode disaggregation through the store.

    kvstore pd-proxy --prefill http://P:8100 --decode http://D:8200 [--port 8000] [--api-key KEY]

Each completion (`POST /v1/completions`, `POST /v1/chat/completions`) goes first to a prefill
instance (a vLLM with the connector as kv_producer) with `max_tokens` 1, no streaming, and
`kv_transfer_params` naming a new hand-off; then to a decode instance (kv_consumer) as the
client sent it, with the `kv_transfer_params` the prefill instance answered, and the decode
instance's answer (streamed, if asked) goes back to the client. A prefill instance that fails
does not fail the request: the decode instance then computes the prompt itself. Several URLs
per side are used in turn. `GET /v1/models` is the decode instance's; `GET /healthz` is open.

Bounded: bodies of at most MAX_BODY bytes (413), JSON objects only (400), unknown paths 404, at
most MAX_CONNECTIONS clients at once, a client that sends nothing for CLIENT_TIMEOUT_S dropped.
A client's own `kv_transfer_params` never reach an instance: the hand-off is the router's. With
`--api-key` every route but /healthz needs `Authorization: Bearer KEY` (401), and binding an
address other than loopback needs one. The backends get the client's Authorization header, or
`--backend-api-key`'s. Plain `http.server`: this is a router for trying the set-up, one
connection per request.
"""

from __future__ import annotations

import hmac
import http.client
import itertools
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Annotated
from urllib.parse import urlsplit

import typer

from kvstore.core.servers import BoundedServer

log = logging.getLogger(__name__)
MAX_BODY = 16 << 20
ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_CONNECTIONS = 256
CLIENT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0
BACKEND_TIMEOUT_S = 600.0  # between two reads of an instance's answer (a long generation streams slowly)
PREFILL_TIMEOUT_S = 120.0  # a prefill instance that takes longer: the decode instance computes the prompt


class Backends:
    """URLs of one side, used in turn."""

    def __init__(self, urls: list[str]) -> None:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s)://HOST:PORT URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._next = itertools.cycle(self.urls)
        self._lock = threading.Lock()

    def pick(self) -> str:
        with self._lock:
            return next(self._next)


class PDProxy:
    def __init__(self, prefill: Backends, decode: Backends, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, backend_api_key: str | None = None,
                 handoff_timeout_s: float | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        self.api_key, self.backend_api_key = api_key, backend_api_key
        self.handoff_timeout_s = handoff_timeout_s
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = BoundedServer((host, port), handler, MAX_CONNECTIONS)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def authorized(self, header: str | None) -> bool:
        return self.api_key is None or (header is not None and hmac.compare_digest(
            header.encode("latin-1", "replace"), f"Bearer {self.api_key}".encode()))

    def prefill_params(self, path: str, body: dict, auth: str | None) -> dict:
        """Send the request to a prefill instance for one token; the kv_transfer_params the decode
        instance gets (the prefill instance's answer, or the hand-off id it was given)."""
        handoff = f"pd-{uuid.uuid4().hex}"
        asked = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
            "handoff_id": handoff, "do_remote_decode": True, "do_remote_prefill": False}}
        for name in ("max_completion_tokens", "stream_options", "n"):
            asked.pop(name, None)
        if "max_completion_tokens" in body:
            asked["max_completion_tokens"] = 1
        url = self.prefill.pick()
        started = time.perf_counter()
        try:
            status, _, answer = _call(url, path, asked, self._backend_auth(auth), PREFILL_TIMEOUT_S)
            answer = json.loads(answer) if status == 200 else None
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            log.warning("prefill instance %s failed (%s): the decode instance computes the prompt", url, exc)
            return {}
        if status != 200:
            log.warning("prefill instance %s answered %s: the decode instance computes the prompt", url, status)
            return {}
        log.info("prefill %s: %.1f ms on %s", handoff, 1e3 * (time.perf_counter() - started), url)
        params = params if isinstance(params, dict) else {"handoff_id": handoff}
        params = {**params, "do_remote_prefill": True, "do_remote_decode": False}
        if self.handoff_timeout_s is not None:
            params["handoff_timeout_s"] = self.handoff_timeout_s
        return params

    def _backend_auth(self, auth: str | None) -> str | None:
        return f"Bearer {self.backend_api_key}" if self.backend_api_key else auth


def _call(base: str, path: str, body: dict, auth: str | None, timeout_s: float):
    """(status, headers, body) of one POST to a backend, read whole within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    connection, response = _open(base, "POST", path, json.dumps(body).encode(), auth, timeout_s)
    try:
        chunks = []
        while chunk := response.read1(65536):
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole answer within {timeout_s:.0f} s")
        return response.status, response.getheaders(), b"".join(chunks)
    finally:
        connection.close()


def _open(base: str, method: str, path: str, data: bytes | None, auth: str | None,
          read_timeout_s: float = BACKEND_TIMEOUT_S):
    parts = urlsplit(base)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=CONNECT_TIMEOUT_S)
    connection.connect()
    connection.sock.settimeout(read_timeout_s)
    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = auth
    connection.request(method, (parts.path or "") + path, body=data, headers=headers)
    return connection, connection.getresponse()


class _Handler(BaseHTTPRequestHandler):
    proxy: PDProxy
    protocol_version = "HTTP/1.0"  # one request per connection: a streamed answer ends when it closes
    timeout = CLIENT_TIMEOUT_S  # a client that sends nothing this long is dropped

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.path == "/healthz":
            self._json(200, {"status": "ok"})
        elif not self.proxy.authorized(self.headers.get("authorization")):
            self._error(401, "a bearer token is needed (the proxy's --api-key)", "authentication_error")
        elif self.path == "/v1/models":
            self._relay(self.proxy.decode.pick(), "GET", self.path, None)
        else:
            self._error(404, f"no route {self.path}", "not_found")

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in ROUTES:
            self._error(404, f"no route {self.path}", "not_found")
        elif not self.proxy.authorized(self.headers.get("authorization")):
            self._error(401, "a bearer token is needed (the proxy's --api-key)", "authentication_error")
        else:
            body = self._body()
            if body is not None:
                self._complete(body)

    def _body(self) -> dict | None:
        value = self.headers.get("content-length", "")
        if not value.isdigit():
            self._error(411 if "content-length" not in self.headers else 400, "a content-length is needed",
                        "invalid_request_error")
            return None
        length = int(value)
        if not 0 <= length <= MAX_BODY:
            self._error(413, f"a request body is at most {MAX_BODY} bytes", "invalid_request_error")
            return None
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._error(400, "the body must be a JSON object", "invalid_request_error")
            return None
        return body

    def _complete(self, body: dict) -> None:
        auth = self.headers.get("authorization")
        body.pop("kv_transfer_params", None)  # the hand-off is the router's, never a client's
        params = self.proxy.prefill_params(self.path, body, auth)
        decode = {**body, "kv_transfer_params": params} if params else body
        self._relay(self.proxy.decode.pick(), "POST", self.path, json.dumps(decode).encode(), auth)

    def _relay(self, base: str, method: str, path: str, data: bytes | None, auth: str | None = None) -> None:
        """The backend's answer, passed on as it arrives (a stream chunk by chunk)."""
        try:
            connection, response = _open(base, method, path, data, self.proxy._backend_auth(
                auth or self.headers.get("authorization")))
        except (OSError, http.client.HTTPException) as exc:
            log.warning("decode instance %s cannot be reached: %s", base, exc)
            self._error(502, "the decode instance cannot be reached", "server_error")
            return
        try:
            self.send_response(response.status)
            for name in ("content-type", "content-length", "cache-control"):
                if response.getheader(name):
                    self.send_header(name, response.getheader(name))
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client left
            pass
        finally:
            connection.close()

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str) -> None:
        """OpenAI's error shape: the clients of this router speak it."""
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def log_message(self, fmt: str, *args) -> None:
        log.debug("pd-proxy: " + fmt, *args)


def pd_proxy(prefill: Annotated[str, typer.Option(help="prefill (kv_producer) instances: URL[,URL...]")],
             decode: Annotated[str, typer.Option(help="decode (kv_consumer) instances: URL[,URL...]")],
             host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
             port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
             api_key: Annotated[str | None, typer.Option(envvar="KVSTORE_PROXY_API_KEY",
                                                         help="clients must send it as a bearer token")] = None,
             backend_api_key: Annotated[str | None, typer.Option(
                 envvar="KVSTORE_BACKEND_API_KEY", help="sent to the instances (default: the client's header)")] = None,
             handoff_timeout_s: Annotated[float | None, typer.Option(min=0.001, max=600, help="how long a decode "
                                                                     "instance waits for a hand-off")] = None) -> None:
    """An OpenAI-compatible router: prefill on one instance, decode on another, KV through the store."""
    from kvstore.cli.serve import is_loopback, service_logging

    service_logging()
    if api_key is None and not is_loopback(host):
        raise typer.BadParameter(f"binding {host} (not loopback) needs --api-key", param_hint="--host")
    try:
        proxy = PDProxy(Backends(prefill.split(",")), Backends(decode.split(",")), host, port, api_key,
                        backend_api_key, handoff_timeout_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    log.info("pd-proxy on %s: prefill %s, decode %s", proxy.url, ",".join(proxy.prefill.urls),
             ",".join(proxy.decode.urls))
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
