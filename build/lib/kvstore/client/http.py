"""JSON over HTTP/1.1 keep-alive connections, with kvstore's error bodies turned back into KVStoreError.

The hot calls (lookup, prepare/complete of saves and loads) are a few hundred microseconds of
directory work, so the client must cost less than that: standard-library connections kept open
per calling thread, Nagle off, and no per-request URL or header machinery. (An httpx client
added about 0.3 ms to every call.)
"""

from __future__ import annotations

import functools
import http.client
import json
import select
import socket
import ssl
import threading
from typing import TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel

from kvstore.core.errors import KVStoreError

M = TypeVar("M", bound=BaseModel)
JSON = {"content-type": "application/json"}
MAX_IDLE = 16  # connections kept open per client


class _NoDelay:
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body are two writes


class _Connection(_NoDelay, http.client.HTTPConnection):
    pass


class _HttpsConnection(_NoDelay, http.client.HTTPSConnection):
    pass


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection the server has closed (or sent stray bytes on) is readable."""
    if conn.sock is None:
        return False  # not connected yet: request() opens it
    try:
        return bool(select.select([conn.sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Certificates checked against `ca_file` (or the system's CAs), host names included."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise KVStoreError("invalid", f"cannot read the CA file {ca_file!r}: {exc}") from None


class JsonHttp:
    """`token` goes in every request as a bearer credential; `ca_file` (else the system's CAs)
    checks an https server's certificate."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None,
                 ca_file: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KVStoreError("invalid", f"not an http(s) URL: {base_url!r}")
        if parts.scheme == "https":
            context = tls_context(ca_file)
            self._connection_class = functools.partial(_HttpsConnection, context=context)
        else:
            self._connection_class = _Connection
        self._host, self._port, self._prefix = parts.hostname, parts.port, parts.path
        self.timeout_s = timeout_s
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def call(self, method: str, path: str, body: BaseModel | None, answer: type[M],
             timeout_s: float | None = None) -> M:
        return answer.model_validate_json(self._request(method, path, body, timeout_s))

    def call_raw(self, method: str, path: str, body: BaseModel | dict | None = None):
        return json.loads(self._request(method, path, body))

    def _request(self, method: str, path: str, body: BaseModel | dict | None,
                 timeout_s: float | None = None) -> bytes:
        if isinstance(body, BaseModel):
            content, headers = body.model_dump_json().encode(), {**self._headers, **JSON}
        elif body:
            content, headers = json.dumps(body).encode(), {**self._headers, **JSON}
        else:
            content, headers = None, self._headers
        status, payload = self._exchange(method, self._prefix + path, content, headers, timeout_s or self.timeout_s)
        if 200 <= status < 300:
            return payload
        try:
            error = json.loads(payload)
        except ValueError:
            error = None
        if isinstance(error, dict) and "error" in error:
            raise KVStoreError.from_body(error)
        raise KVStoreError("internal", f"HTTP {status} from {self.base_url}{path}",
                           body=payload[:500].decode(errors="replace"))

    def _exchange(self, method: str, path: str, content: bytes | None, headers: dict[str, str],
                  timeout_s: float) -> tuple[int, bytes]:
        """One request and its whole response. A reused connection that fails before any answer
        arrived (the server closed it while idle) is retried once on a new connection."""
        conn, reused = self._checkout(timeout_s)
        try:
            while True:
                try:
                    conn.request(method, path, content, headers)
                    response = conn.getresponse()
                    payload = response.read()
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                    conn.close()
                    if not reused:
                        raise self._unreachable(path, exc) from None
                    reused = False
                except (OSError, http.client.HTTPException) as exc:
                    conn.close()
                    raise self._unreachable(path, exc) from None
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        self._checkin(conn)
        return response.status, payload

    def _unreachable(self, path: str, exc: Exception) -> KVStoreError:
        reason = str(exc) or type(exc).__name__
        return KVStoreError("unavailable", f"cannot reach {self.base_url}: {reason}", url=self.base_url + path)

    def _checkout(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None and _closed_by_peer(conn):
            conn.close()
        if conn is None:
            conn = self._connection_class(self._host, self._port, timeout=timeout_s)
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
            return conn, True
        conn.timeout = timeout_s
        return conn, False

    def _checkin(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
