"""The one error type of kvstore and its closed set of kinds.

Every failure that crosses a layer boundary is a `KVStoreError(kind, message,
**context)`. The directory maps `kind` to an HTTP status in one handler and
answers `{"error": kind, "detail": message, "context": {...}}`; the HTTP client
turns such a body back into the same exception.
"""

from __future__ import annotations

import math
from typing import Any

# kind -> HTTP status. Closed set: adding a kind is a deliberate change.
HTTP_STATUS: dict[str, int] = {
    "invalid": 400,  # malformed or inconsistent input
    "unauthorized": 401,  # no credential, or one the directory does not know
    "forbidden": 403,  # a credential without the scope the call needs
    "not_found": 404,
    "method_not_allowed": 405,  # a path that exists, asked with a method it does not have
    "too_large": 413,  # a request body over the limit
    "conflict": 409,  # stale epoch, unknown/expired/duplicate token
    "no_space": 507,  # no tier has room
    "throttled": 429,
    "unavailable": 503,  # a worker or backend cannot be reached
    "transfer_failed": 502,  # NIXL reported a failure
    "checksum_mismatch": 502,
    "internal": 500,
}


def error_list(errors: list[dict]) -> list[dict]:
    """A validator's errors (pydantic's shape) as an error body's context carries them: where, what."""
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in errors]


class KVStoreError(Exception):
    """An expected failure, with a kind from `HTTP_STATUS` and free-form context."""

    def __init__(self, kind: str, message: str, **context: Any) -> None:
        assert kind in HTTP_STATUS, f"unknown error kind {kind!r}"
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.context = context

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.kind]

    def headers(self) -> dict[str, str]:
        """HTTP headers an answer carrying this error has: how to authenticate (401), the methods
        the path takes (405), and when to ask again (429, and 503 when the server knows)."""
        if self.kind == "unauthorized":
            return {"www-authenticate": "Bearer"}
        if self.kind == "method_not_allowed":
            return {"allow": ", ".join(self.context.get("allow", ()))}
        retry = self.context.get("retry_after_s")
        if self.kind == "throttled" or (self.kind == "unavailable" and isinstance(retry, (int, float))):
            return {"retry-after": str(max(1, math.ceil(retry if isinstance(retry, (int, float)) else 1)))}
        return {}

    def to_body(self) -> dict[str, Any]:
        return {"error": self.kind, "detail": self.message, "context": self.context}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "KVStoreError":
        kind = body.get("error")
        if kind not in HTTP_STATUS:
            kind = "internal"
        return cls(kind, str(body.get("detail")), **(body.get("context") or {}))

    def __str__(self) -> str:
        if not self.context:
            return f"{self.kind}: {self.message}"
        ctx = ", ".join(f"{k}={v}" for k, v in self.context.items())
        return f"{self.kind}: {self.message} ({ctx})"


class Unreachable(KVStoreError):
    """`unavailable` because the server could not be reached at all (nothing was asked of it), as
    opposed to a server that answered 503: callers that report may tell the two apart."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__("unavailable", message, **context)
