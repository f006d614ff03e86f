"""Who may call what: scoped bearer tokens, tenants, and a request rate per engine token.

    engine  the hot calls, namespaces, worker metadata; bound to tenants: it sees only namespaces
            whose `tenant` is one of its own (any other looks like a namespace that does not exist)
    worker  register, heartbeat and deregister (only the name it registered)
    read    metrics, tiers, workers, stats
    admin   every call, every tenant; tokens, evictions, drains, namespace policies

`ROUTES` names the scopes of every route the app serves; the app refuses to start with a route
missing from it, and the tests call every route without a token. `Guard.check` runs in front of
every request, the hot calls' included, before its body is read. Tokens are `kvs_` and 43 random
characters; SQL keeps only their SHA-256 (a lookup of a high-entropy secret needs no slow hash),
and each directory keeps the live ones in memory, read again from SQL every few seconds.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from dataclasses import dataclass

from kvstore.core import credentials as specs
from kvstore.core.credentials import ADMIN, ENGINE, READ, SCOPES, WORKER
from kvstore.core.errors import KVStoreError
from kvstore.directory.db import tokens as sql
from kvstore.directory.db.models import TokenRow

PUBLIC: frozenset[str] = frozenset()
PRINCIPAL = "kvstore.principal"  # key of the caller in an ASGI scope


def _s(*scopes: str) -> frozenset[str]:
    return frozenset(scopes)


ROUTES: dict[tuple[str, str], frozenset[str]] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/metrics"): _s(READ),
    ("GET", "/openapi.json"): _s(ENGINE, WORKER, READ),
    ("POST", "/v1/namespaces"): _s(ENGINE),
    ("GET", "/v1/namespaces"): _s(ENGINE, READ),  # an engine sees its own tenants' only
    ("PUT", "/v1/namespaces/{namespace_id}/policy"): _s(ADMIN),
    ("POST", "/v1/lookup"): _s(ENGINE),
    ("POST", "/v1/lookup/batch"): _s(ENGINE),
    ("POST", "/v1/lookup/tokens"): _s(ENGINE),
    ("POST", "/v1/store/prepare"): _s(ENGINE),
    ("POST", "/v1/store/complete"): _s(ENGINE),
    ("POST", "/v1/store/abort"): _s(ENGINE),
    ("POST", "/v1/load/prepare"): _s(ENGINE),
    ("POST", "/v1/load/prepare-batch"): _s(ENGINE),
    ("POST", "/v1/load/complete"): _s(ENGINE),
    ("POST", "/v1/leases/renew"): _s(ENGINE),
    ("POST", "/v1/handoffs"): _s(ENGINE),
    ("POST", "/v1/handoffs/wait"): _s(ENGINE),
    ("POST", "/v1/workers"): _s(WORKER),
    ("POST", "/v1/workers/{name}/heartbeat"): _s(WORKER),
    ("POST", "/v1/workers/{name}/deregister"): _s(WORKER),
    ("POST", "/v1/workers/{name}/drain"): _s(ADMIN),
    ("POST", "/v1/workers/{name}/undrain"): _s(ADMIN),
    ("GET", "/v1/workers"): _s(READ),
    ("GET", "/v1/workers/{name}"): _s(ENGINE, READ),  # engines read a worker's NIXL metadata
    ("GET", "/v1/tiers"): _s(READ),
    ("GET", "/v1/admin/stats"): _s(READ),
    ("POST", "/v1/admin/evict"): _s(ADMIN),
    ("POST", "/v1/admin/inspect"): _s(ADMIN),  # what a tenant's prompts hold and when they were read
    ("POST", "/v1/admin/tokens"): _s(ADMIN),
    ("GET", "/v1/admin/tokens"): _s(ADMIN),
    ("POST", "/v1/admin/tokens/{token_id}/revoke"): _s(ADMIN),
}


@dataclass(frozen=True)
class Principal:
    id: str  # the token's id; '' when credentials are off
    name: str
    scopes: frozenset[str]
    tenants: frozenset[str] | None  # None: every tenant

    def allows(self, needed: frozenset[str]) -> bool:
        return not needed or ADMIN in self.scopes or bool(needed & self.scopes)

    @property
    def limited(self) -> bool:
        return ENGINE in self.scopes and ADMIN not in self.scopes


ANONYMOUS = Principal("", "anonymous", frozenset(SCOPES), None)  # credentials off (loopback only)
NOBODY = Principal("", "nobody", PUBLIC, frozenset())  # a request that did not pass the guard


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _info(row: TokenRow) -> specs.TokenInfo:
    return specs.TokenInfo(id=row.id, name=row.name, scopes=list(row.scopes), tenants=list(row.tenants),
                           created_at=row.created_at, revoked_at=row.revoked_at)


class Tokens:
    """The live tokens by digest, from SQL; create and revoke write through the directory's writer."""

    def __init__(self, sessions, write, clock=time.time) -> None:
        self._sessions = sessions
        self._write = write
        self._clock = clock
        self._by_digest: dict[str, Principal] = {}
        self._lock = threading.Lock()
        self._changes = 0  # creations and revocations made here; a reload that began before one is dropped

    def load(self) -> None:
        with self._lock:
            changes = self._changes
        with self._sessions() as session:
            rows = sql.live(session)
            fresh = {row.digest: _principal(row) for row in rows}
        with self._lock:
            if changes == self._changes:
                self._by_digest = fresh

    def authenticate(self, secret: str) -> Principal | None:
        return self._by_digest.get(digest(secret))

    def create(self, req: specs.TokenCreate, secret: str | None = None) -> specs.TokenCreated | None:
        """A new token. `secret`: take this well-formed one instead of drawing one (a token an operator
        chose, e.g. kept in a Kubernetes Secret); None if the database has seen it before (revoked)."""
        if ENGINE in req.scopes and not req.tenants:
            raise KVStoreError("invalid", "an engine token needs at least one tenant (--tenant)")
        if req.tenants and ENGINE not in req.scopes:
            raise KVStoreError("invalid", "tenants bind engine tokens only; add the engine scope or drop them")
        if secret is not None and not re.fullmatch(specs.TOKEN_PATTERN, secret):
            raise KVStoreError("invalid", "a token is kvs_ and 43 URL-safe base64 characters")
        secret = secret or "kvs_" + secrets.token_urlsafe(32)
        row = TokenRow(id=secrets.token_hex(8), name=req.name, digest=digest(secret), scopes=sorted(set(req.scopes)),
                       tenants=sorted(set(req.tenants)), created_at=self._clock(), revoked_at=None)

        def job(tx) -> bool:
            if sql.digest_seen(tx.session, row.digest):
                return False
            sql.add(tx.session, row)
            return True
        try:
            if not self._write(job):
                return None
        except sql.Duplicate:  # another directory adopted the same token just now
            return None
        with self._lock:
            self._changes += 1
            self._by_digest = {**self._by_digest, row.digest: _principal(row)}
        return specs.TokenCreated(token=secret, info=_info(row))

    def revoke(self, token_id: str) -> specs.TokenInfo:
        def job(tx) -> specs.TokenInfo:
            row = sql.token(tx.session, token_id)
            if row is None:
                raise KVStoreError("not_found", f"no token {token_id!r}", token_id=token_id)
            if row.revoked_at is None and ADMIN in row.scopes and not any(
                    ADMIN in other.scopes for other in sql.live(tx.session) if other.id != row.id):
                raise KVStoreError("conflict", f"token {token_id} is the last live admin token: revoking it would "
                                   "lock every operator out; create another (kvstore tokens create --scope admin) "
                                   "first", token_id=token_id)
            row.revoked_at = row.revoked_at or self._clock()
            return _info(row)
        info = self._write(job)
        with self._lock:
            self._changes += 1
            self._by_digest = {d: p for d, p in self._by_digest.items() if p.id != token_id}
        return info

    def list(self) -> list[specs.TokenInfo]:
        with self._sessions() as session:
            return [_info(row) for row in sql.every(session)]


def _principal(row: TokenRow) -> Principal:
    scopes = frozenset(row.scopes)
    bound = ENGINE in scopes and ADMIN not in scopes  # only engine tokens are bound to tenants
    return Principal(row.id, row.name, scopes, frozenset(row.tenants) if bound else None)


class RateLimit:
    """A token bucket per engine token: `rate` requests a second, bursts of `burst`."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # token id -> (level, when)
        self._lock = threading.Lock()

    def take(self, key: str, now: float) -> float:
        """0 when the request may go; else the seconds until it could."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            level, then = self._buckets.get(key, (self.burst, now))
            level = min(self.burst, level + (now - then) * self.rate)
            if level < 1:
                self._buckets[key] = (level, now)
                return (1 - level) / self.rate
            self._buckets[key] = (level - 1, now)
            return 0.0


def flat_routes(routes) -> list:
    """The app's routes, those of included routers (which add no prefix here) in their place."""
    out = []
    for route in routes:
        included = getattr(route, "original_router", None)
        out += flat_routes(included.routes) if included is not None else [route]
    return out


class Guard:
    """Finds the route of a request, the scopes it needs, and the caller; refuses with 401, 403 or 429."""

    def __init__(self, routes, tokens: Tokens, require_auth: bool, open_metrics: bool, limit: RateLimit) -> None:
        self.tokens = tokens
        self.require_auth = require_auth
        self.limit = limit
        self._exact: dict[tuple[str, str], tuple[str, frozenset[str]]] = {}
        self._patterns: list[tuple[str, object, str, frozenset[str]]] = []
        for route in flat_routes(routes):
            for method in sorted(getattr(route, "methods", None) or ()):
                if method == "HEAD":
                    continue
                needed = ROUTES.get((method, route.path))
                if needed is None:
                    raise RuntimeError(f"route {method} {route.path} has no scopes in kvstore.directory.http.auth.ROUTES")
                if route.path == "/metrics" and open_metrics:
                    needed = PUBLIC
                if "{" in route.path:
                    self._patterns.append((method, route.path_regex, route.path, needed))
                else:
                    self._exact[(method, route.path)] = (route.path, needed)

    def route(self, method: str, path: str) -> tuple[str, frozenset[str]] | None:
        """The route's template (what metrics are labelled with) and the scopes it needs; None when
        no route answers."""
        method = "GET" if method == "HEAD" else method
        found = self._exact.get((method, path))
        if found is not None:
            return found
        for m, regex, template, scopes in self._patterns:
            if m == method and regex.fullmatch(path):
                return template, scopes
        return None

    def methods(self, path: str) -> list[str]:
        """The methods some route answers at `path` (HEAD wherever GET is), for a 405's Allow."""
        found = {m for m, p in self._exact if p == path} | {m for m, regex, _, _ in self._patterns
                                                              if regex.fullmatch(path)}
        return sorted(found | ({"HEAD"} if "GET" in found else set()))

    def check(self, method: str, path: str, authorization: bytes | None) -> Principal:
        """The caller, or a refusal; a request no route answers is refused here too (404), so that
        nothing the guard did not classify ever reaches the app."""
        return self.admit(method, path, authorization, self.route(method, path))

    def admit(self, method: str, path: str, authorization: bytes | None,
              route: tuple[str, frozenset[str]] | None) -> Principal:
        """`check` with the route found already."""
        if route is None:
            allowed = self.methods(path)
            if allowed:
                raise KVStoreError("method_not_allowed", f"{path[:200]} takes {', '.join(allowed)}, not {method[:20]}",
                                   allow=allowed)
            raise KVStoreError("not_found", f"no route {method} {path[:200]}")
        needed = route[1]
        if not self.require_auth:
            return ANONYMOUS
        if not needed:
            return NOBODY
        if not authorization or not authorization.startswith(b"Bearer "):
            raise KVStoreError("unauthorized", "this call needs a token: send 'Authorization: Bearer <token>' "
                               "(kvstore tokens create)")
        principal = self.tokens.authenticate(authorization[7:].strip().decode("latin-1"))
        if principal is None:
            raise KVStoreError("unauthorized", "unknown or revoked token")
        if not principal.allows(needed):
            raise KVStoreError("forbidden", f"this call needs a token with scope {' or '.join(sorted(needed))}",
                               token_id=principal.id)
        if principal.limited:
            wait = self.limit.take(principal.id, time.monotonic())
            if wait:
                raise KVStoreError("throttled", f"over {self.limit.rate:g} requests/s for this token; retry later",
                                   retry_after_s=round(wait, 3))
        return principal
