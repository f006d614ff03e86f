"""FastAPI application: thin endpoints over DirectoryService, errors as kvstore bodies."""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstore.core import credentials, specs
from kvstore.core.errors import KVStoreError, error_list
from kvstore.core.handoffs import HandoffCommit, HandoffState, HandoffWait
from kvstore.core.inspection import InspectRequest, InspectResult
from kvstore.core.namespaces import NamespaceInfo
from kvstore.directory import db, wire
from kvstore.directory.auth import NOBODY, PRINCIPAL, Guard, Principal, RateLimit, Tokens
from kvstore.directory.hot import HotCalls, HotPath, document_bodies, hot_routes
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.replicas import Replicas
from kvstore.directory.service import DirectoryService
from kvstore.directory.settings import DirectorySettings

log = logging.getLogger(__name__)
# Threads that wait for the GIL (the writer, saves in the thread pool) get it after at most this long
# while the event loop answers lookups; Python's default, 5 ms, starves them under a lookup load.
GIL_SWITCH_S = 0.002
TOKENS_RELOAD_S = 5.0
READY_CACHE_S = 1.0  # /readyz reads the database at most this often


class NamespaceBody(BaseModel):
    namespace: dict


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


def create_app(settings: DirectorySettings | None = None):
    """The directory as an ASGI app: FastAPI behind the hot calls' path. `.state.service` is the
    service, `.fastapi` the framework app (routes, OpenAPI)."""
    app = create_fastapi(settings)
    settings = app.state.service.settings
    guard = Guard(app.routes, app.state.tokens, settings.require_auth, settings.open_metrics,
                  RateLimit(settings.engine_rate, settings.engine_burst))
    fast = HotPath(app, app.state.hot, guard, app.state.service.metrics, app.state.replicas)
    fast.state, fast.fastapi = app.state, app
    return fast


def create_fastapi(settings: DirectorySettings | None = None) -> FastAPI:
    settings = settings or DirectorySettings()
    if settings.migrate_on_start:
        db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)
    sessions = db.make_sessions(engine)
    service = DirectoryService(sessions, settings, DirectoryMetrics())
    tokens = Tokens(sessions, service.writer.run)
    tokens.load()
    replicas = Replicas(service, engine, settings.advertise_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        stop = threading.Event()
        reaper = threading.Thread(target=_background, args=(service, replicas, tokens, stop), name="reaper",
                                  daemon=True)
        reaper.start()
        yield
        stop.set()
        reaper.join(timeout=5)
        service.flush()
        replicas.close()
        service.close()
        engine.dispose()

    sys.setswitchinterval(GIL_SWITCH_S)
    app = FastAPI(title="kvstore directory", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service, app.state.tokens, app.state.replicas = service, tokens, replicas
    _add_error_handlers(app)
    app.include_router(_routes(service, replicas), responses=ERRORS)
    app.include_router(_token_routes(tokens), responses=ERRORS)
    app.state.hot = HotCalls(service)
    app.include_router(hot_routes(app.state.hot), responses=ERRORS)
    document_bodies(app)
    return app


class _Readiness:
    """Whether the database answers, asked at most once per READY_CACHE_S however many probes ask:
    /readyz is open to anyone and must not become a way to load the database."""

    def __init__(self, service: DirectoryService) -> None:
        self._service = service
        self._lock = threading.Lock()
        self._at, self._failure = -READY_CACHE_S, ""

    def database(self) -> str:
        """"" when the database answered, else why not."""
        with self._lock:  # one query at a time; the others wait for it and share its answer
            if time.monotonic() - self._at >= READY_CACHE_S:
                try:
                    self._service.ping_database()
                    self._failure = ""
                except Exception as exc:  # noqa: BLE001 (any database failure makes the directory unready)
                    log.warning("readyz: the database does not answer: %s", exc)
                    self._failure = type(exc).__name__
                self._at = time.monotonic()
            return self._failure


def _unready(reason: str, **context) -> JSONResponse:
    return JSONResponse(KVStoreError("unavailable", reason, **context).to_body(), status_code=503)


def _background(service: DirectoryService, replicas: Replicas, tokens: Tokens, stop: threading.Event) -> None:
    """Build the index (readyz answers 503 until then); the leader reaps every tick; every replica
    reads the tokens again every TOKENS_RELOAD_S (the leader may have changed them)."""
    loaded = [time.monotonic()]

    def reap() -> None:
        try:
            service.reap()
        except Exception:  # the loop must survive a bad tick (e.g. database briefly away)
            log.exception("reaper tick failed")

    def refresh() -> None:
        if time.monotonic() - loaded[0] > TOKENS_RELOAD_S:
            try:
                tokens.load()
                loaded[0] = time.monotonic()
            except Exception:
                log.exception("reading the tokens again failed")
    try:
        replicas.run(stop, reap, refresh)
    except Exception:
        log.exception("the directory's background thread stopped")


def caller(request: Request) -> Principal:
    """The caller the guard let in (NOBODY if the request did not pass it)."""
    return request.scope.get(PRINCIPAL, NOBODY)


Caller = Depends(caller)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVStoreError)
    async def _kvstore_error(_request: Request, exc: KVStoreError):
        return JSONResponse(exc.to_body(), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        errors = error_list(exc.errors())
        body = KVStoreError("invalid", "request body does not match the schema", errors=errors).to_body()
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(_request: Request, exc: StarletteHTTPException):
        """The framework's own refusals (unparsable JSON, unknown route, wrong method) in kvstore's body."""
        kind = {401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "too_large"}.get(
            exc.status_code, "invalid" if exc.status_code < 500 else "internal")
        return JSONResponse(KVStoreError(kind, str(exc.detail)).to_body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(KVStoreError("internal", type(exc).__name__).to_body(), status_code=500)


def _routes(service: DirectoryService, replicas: Replicas) -> APIRouter:
    r = APIRouter()

    @r.get("/healthz")
    def healthz() -> Response:
        """200 while the process serves; 503 once a replica that lost the lead stopped serving."""
        if replicas.retired:
            return _unready(f"this directory replica stopped serving: {replicas.retired}; restart it")
        return JSONResponse({"status": "ok"})

    readiness = _Readiness(service)

    @r.get("/readyz")
    def readyz(workers: int = Query(1, ge=0, le=1_000_000, description="live workers needed; 0: only the "
                                    "index and the database")) -> Response:
        """200 when the directory can serve: its index is built, the database answers, and at least
        `workers` workers are live; 503 with the reason otherwise."""
        if replicas.retired:
            return _unready(f"this directory replica stopped serving: {replicas.retired}")
        if not service.index.ready:
            return _unready("building the lookup index")
        failure = readiness.database()
        if failure:
            return _unready(f"the database does not answer ({failure})")
        if not replicas.leading and not replicas.leader_url:
            return _unready("no directory replica leads yet")
        live = service.membership.live_count() if replicas.leading else replicas.live_workers
        if live < workers:
            return _unready(f"{live} live workers, {workers} needed", live_workers=live)
        return JSONResponse({"status": "ready", "indexed_blocks": service.index.num_blocks, "live_workers": live,
                             "leader": replicas.leading})

    @r.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        body = service.metrics.render(service.stats(), service.tiers() if replicas.leading else [],
                                      service.membership.workers())
        return Response(body, media_type="text/plain; version=0.0.4")

    @r.post("/v1/namespaces")
    def register_namespace(body: NamespaceBody, who: Principal = Caller) -> dict:
        return {"namespace_id": service.register_namespace(body.namespace, who.tenants)}

    @r.get("/v1/namespaces")
    def namespaces(who: Principal = Caller) -> list[NamespaceInfo]:
        return service.namespaces(who.tenants)

    @r.put("/v1/namespaces/{namespace_id}/policy")
    def set_policy(namespace_id: str, body: specs.NamespacePolicy) -> specs.NamespacePolicy:
        return service.set_policy(namespace_id, body)

    @r.post("/v1/workers")
    def register_worker(body: specs.WorkerRegistration, who: Principal = Caller) -> specs.Registered:
        return service.membership.register_worker(body, who.id)

    @r.post("/v1/workers/{name}/heartbeat")
    def heartbeat(name: str, body: specs.Heartbeat, who: Principal = Caller) -> dict:
        service.membership.heartbeat(name, body.epoch, who.id)
        return {"ok": True}

    @r.post("/v1/workers/{name}/deregister")
    def deregister(name: str, body: specs.Heartbeat, who: Principal = Caller) -> dict:
        service.membership.deregister(name, body.epoch, who.id)
        return {"ok": True}

    @r.post("/v1/workers/{name}/drain")
    def drain(name: str) -> specs.WorkerInfo:
        return service.membership.drain(name)

    @r.post("/v1/workers/{name}/undrain")
    def undrain(name: str) -> specs.WorkerInfo:
        return service.membership.undrain(name)

    @r.get("/v1/workers")
    def workers() -> list[specs.WorkerInfo]:
        return service.membership.workers()

    @r.get("/v1/workers/{name}")
    def worker(name: str) -> specs.WorkerInfo:
        return service.membership.worker(name)

    @r.post("/v1/handoffs")
    def commit_handoff(body: HandoffCommit, who: Principal = Caller) -> HandoffState:
        """A producer: every save of the hand-off's prompt has committed (or, `failed`, never will)."""
        service.namespace(body.namespace_id, who.tenants)
        return service.handoffs.commit(body)

    @r.post("/v1/handoffs/wait")
    async def wait_handoff(body: HandoffWait, who: Principal = Caller) -> HandoffState:
        """A consumer: answers once the hand-off is committed or failed, once every block named is
        stored, or after `timeout_s` (state `pending`)."""
        service.namespace(body.namespace_id, who.tenants)
        return await service.handoffs.wait(body)

    @r.post("/v1/leases/renew")
    def renew(body: specs.TokenBody) -> specs.Renewed:
        return service.store.renew(body.token)

    @r.post("/v1/store/abort")
    def abort_store(body: specs.TokenBody) -> dict:
        return {"rolled_back": service.store.abort(body.token)}

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

    @r.get("/v1/tiers")
    def tiers() -> list[specs.TierUsage]:
        return service.tiers()

    @r.post("/v1/admin/evict")
    def evict(body: specs.EvictRequest) -> specs.Evicted:
        if body.tier is None:
            if body.namespace_id is None and not body.all:
                raise KVStoreError("invalid", "this drops every replica of every namespace, S3 included: "
                                   "say \"all\": true, or name a namespace_id or a tier")
            return service.evict(body.namespace_id, body.dry_run)
        return service.evict_tier(body)

    @r.get("/v1/admin/stats")
    def stats() -> specs.Stats:
        return service.stats()

    return r


def _token_routes(tokens: Tokens) -> APIRouter:
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
