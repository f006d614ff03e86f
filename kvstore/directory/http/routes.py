"""The directory's routes: thin calls of the service, errors as kvstore bodies.

The hot calls (lookups, saves, loads) are `hot.py`, ahead of FastAPI; these are
the rest: health, namespaces, workers, hand-offs, leases, operator calls, tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from typing import Annotated

from pydantic import BaseModel, Field, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstore.core import credentials, specs
from kvstore.core.errors import KVStoreError, error_list
from kvstore.core.handoffs import HandoffCommit, HandoffState, HandoffWait
from kvstore.core.inspection import InspectRequest, InspectResult
from kvstore.core.keys import Namespace
from kvstore.core.namespaces import NamespaceInfo
from kvstore.directory import wire
from kvstore.directory.admin import Admin
from kvstore.directory.db.engine import outage
from kvstore.directory.http.auth import NOBODY, PRINCIPAL, Principal, Tokens
from kvstore.directory.replica.leader import LAG_S, Leader
from kvstore.directory.namespaces import Namespaces
from kvstore.directory.replica.service import DirectoryService
from kvstore.directory.workers.membership import Membership

log = logging.getLogger(__name__)
READY_CACHE_S = 1.0  # /readyz reads the database at most this often


class NamespaceBody(BaseModel):
    namespace: Annotated[dict, WithJsonSchema(Namespace.json_schema())]  # checked by Namespace.from_dict


class ErrorBody(BaseModel):
    """Every answer that is not a 2xx."""

    error: str = Field(description="one of the kinds of kvstore.core.errors")
    detail: str
    context: dict


ERRORS = {status: {"model": ErrorBody, "description": kind}
          for status, kind in ((400, "invalid input"), (401, "no or unknown token"), (403, "token lacks the scope"),
                               (404, "not found"), (409, "conflict"), (413, "body too large"),
                               (429, "over the token's rate"), (500, "internal"), (502, "a worker failed"),
                               (503, "unavailable"), (507, "no space"))}


class _Readiness:
    """Whether the database answers, asked at most once per READY_CACHE_S however many probes ask:
    /readyz is open to anyone and must not become a way to load the database."""

    def __init__(self, ping: Callable[[], None]) -> None:
        self._ping = ping
        self._lock = threading.Lock()
        self._at, self._failure = -READY_CACHE_S, ""

    def database(self) -> str:
        """"" when the database answered, else why not."""
        with self._lock:  # one query at a time; the others wait for it and share its answer
            if time.monotonic() - self._at >= READY_CACHE_S:
                try:
                    self._ping()
                    self._failure = ""
                except Exception as exc:  # noqa: BLE001 (any database failure makes the directory unready)
                    log.warning("readyz: the database does not answer: %s", exc)
                    self._failure = type(exc).__name__
                self._at = time.monotonic()
            return self._failure


def _unready(reason: str, **context) -> JSONResponse:
    return JSONResponse(KVStoreError("unavailable", reason, **context).to_body(), status_code=503)


def caller(request: Request) -> Principal:
    """The caller the guard let in (NOBODY if the request did not pass it)."""
    return request.scope.get(PRINCIPAL, NOBODY)


Caller = Depends(caller)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVStoreError)
    async def _kvstore_error(_request: Request, exc: KVStoreError):
        return JSONResponse(exc.to_body(), status_code=exc.http_status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        errors = error_list(exc.errors())
        body = KVStoreError("invalid", "request body does not match the schema", errors=errors).to_body()
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(_request: Request, exc: StarletteHTTPException):
        """The framework's own refusals (unparsable JSON, unknown route, wrong method) in kvstore's body."""
        kind = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                413: "too_large"}.get(
            exc.status_code, "invalid" if exc.status_code < 500 else "internal")
        return JSONResponse(KVStoreError(kind, str(exc.detail)).to_body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        error = outage(exc)  # the database away: 503, which clients treat as a miss or try again
        if error is None:
            log.exception("unhandled error")
            error = KVStoreError("internal", type(exc).__name__)
        return JSONResponse(error.to_body(), status_code=error.http_status)


def health_routes(service: DirectoryService, admin: Admin, leader: Leader) -> APIRouter:
    r = APIRouter()

    @r.get("/healthz")
    def healthz() -> Response:
        """200 while the process serves (a replica that lost the lead follows again: it serves)."""
        return JSONResponse({"status": "ok"})

    readiness = _Readiness(admin.ping_database)

    @r.get("/readyz")
    def readyz(workers: int = Query(1, ge=0, le=1_000_000, description="live workers needed; 0: only the "
                                    "index and the database")) -> Response:
        """200 when the directory can serve: its index is built, the database answers, and at least
        `workers` workers are live; 503 with the reason otherwise."""
        if leader.stepping_down:
            return _unready(f"this directory replica lost the lead ({leader.stepping_down}); it follows again shortly")
        if not service.ready:
            return _unready("building the lookup index")
        failure = readiness.database()
        if failure:
            return _unready(f"the database does not answer ({failure})")
        if not leader.leading and not leader.leader_url:
            return _unready("no directory replica leads yet")
        if not leader.leading and leader.lag_s > LAG_S:
            return _unready(f"this follower has not read the leader's changes for {leader.lag_s:.0f} s "
                            "(the database does not answer it)", lag_s=round(leader.lag_s, 1))
        live = service.membership.live_count() if leader.leading else leader.live_workers
        if live < workers:
            return _unready(f"{live} live workers, {workers} needed", live_workers=live)
        return JSONResponse({"status": "ready", "indexed_blocks": service.indexed_blocks, "live_workers": live,
                             "leader": leader.leading})

    @r.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        body = admin.metrics_text()
        return Response(body, media_type="text/plain; version=0.0.4")

    return r


def namespace_routes(namespaces: Namespaces) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/namespaces")
    def register_namespace(body: NamespaceBody, who: Principal = Caller) -> dict:
        return {"namespace_id": namespaces.register(body.namespace, who.tenants)}

    @r.get("/v1/namespaces")
    def listed(who: Principal = Caller) -> list[NamespaceInfo]:
        return namespaces.listed(who.tenants)

    @r.put("/v1/namespaces/{namespace_id}/policy")
    def set_policy(namespace_id: str, body: specs.NamespacePolicy) -> specs.NamespacePolicy:
        return namespaces.set_policy(namespace_id, body)

    return r


def worker_routes(membership: Membership) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/workers")
    def register_worker(body: specs.WorkerRegistration, who: Principal = Caller) -> specs.Registered:
        return membership.register_worker(body, who.id)

    @r.post("/v1/workers/{name}/heartbeat")
    def heartbeat(name: str, body: specs.Heartbeat, who: Principal = Caller) -> dict:
        membership.heartbeat(name, body.epoch, who.id)
        return {"ok": True}

    @r.post("/v1/workers/{name}/deregister")
    def deregister(name: str, body: specs.Heartbeat, who: Principal = Caller) -> dict:
        membership.deregister(name, body.epoch, who.id)
        return {"ok": True}

    @r.post("/v1/workers/{name}/drain")
    def drain(name: str) -> specs.WorkerInfo:
        return membership.drain(name)

    @r.post("/v1/workers/{name}/undrain")
    def undrain(name: str) -> specs.WorkerInfo:
        return membership.undrain(name)

    @r.get("/v1/workers")
    def workers() -> list[specs.WorkerInfo]:
        return membership.workers()

    @r.get("/v1/workers/{name}")
    def worker(name: str) -> specs.WorkerInfo:
        return membership.worker(name)

    return r


def engine_routes(service: DirectoryService) -> APIRouter:
    """An engine's calls other than the hot ones (`hot.py`), each checked against its tenants."""
    r = APIRouter()

    @r.post("/v1/handoffs")
    def commit_handoff(body: HandoffCommit, who: Principal = Caller) -> HandoffState:
        """A producer: every save of the hand-off's prompt has committed (or, `failed`, never will)."""
        return service.commit_handoff(body, who.tenants)

    @r.post("/v1/handoffs/wait")
    async def wait_handoff(body: HandoffWait, who: Principal = Caller) -> HandoffState:
        """A consumer: answers once the hand-off is committed or failed, once every block named is
        stored, or after `timeout_s` (state `pending`)."""
        return await service.wait_handoff(body, who.tenants, who.id)

    @r.post("/v1/leases/renew")
    def renew(body: specs.TokenBody) -> specs.Renewed:
        return service.renew(body.token)

    @r.post("/v1/store/abort")
    def abort_store(body: specs.TokenBody) -> dict:
        return {"rolled_back": service.abort_store(body.token)}

    @r.post("/v1/lookup/batch")
    def lookup_batch(body: specs.LookupBatchRequest, who: Principal = Caller) -> Response:
        results = [service.lookup(body.namespace_id, p, tenants=who.tenants) for p in body.prompts]
        return Response(wire.encode({"results": results}), media_type="application/json")

    @r.post("/v1/lookup/tokens")
    def lookup_tokens(body: specs.TokenLookupRequest, who: Principal = Caller) -> specs.TokenLookupResult:
        return service.lookup_tokens(body.namespace_id, body.token_ids, who.tenants, body.hash_seed)

    @r.post("/v1/admin/inspect")
    def inspect(body: InspectRequest, who: Principal = Caller) -> InspectResult:
        return service.inspect(body, who.tenants)

    return r


def admin_routes(admin: Admin) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/tiers")
    def tiers() -> list[specs.TierUsage]:
        return admin.tiers()

    @r.post("/v1/admin/evict")
    def evict(body: specs.EvictRequest) -> specs.Evicted:
        if body.tier is None:
            if body.namespace_id is None and not body.all:
                raise KVStoreError("invalid", "this drops every replica of every namespace, S3 included: "
                                   "say \"all\": true, or name a namespace_id or a tier")
            return admin.evict(body.namespace_id, body.dry_run)
        return admin.evict_tier(body)

    @r.get("/v1/admin/stats")
    def stats() -> specs.Stats:
        return admin.stats()

    return r


def token_routes(tokens: Tokens) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/admin/tokens")
    def create_token(body: credentials.TokenCreate) -> credentials.TokenCreated:
        return tokens.create(body)

    @r.get("/v1/admin/tokens")
    def list_tokens() -> list[credentials.TokenInfo]:
        return tokens.list()

    @r.post("/v1/admin/tokens/{token_id}/revoke")
    def revoke_token(token_id: str) -> credentials.TokenInfo:
        return tokens.revoke(token_id)

    return r
