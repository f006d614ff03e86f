"""FastAPI application: thin endpoints over DirectoryService, errors as kvstore bodies."""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.directory import db, wire
from kvstore.directory.hot import HotCalls, HotPath, document_bodies, hot_routes
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.service import DirectoryService
from kvstore.directory.settings import DirectorySettings

log = logging.getLogger(__name__)
# Threads that wait for the GIL (the writer, saves in the thread pool) get it after at most this long
# while the event loop answers lookups; Python's default, 5 ms, starves them under a lookup load.
GIL_SWITCH_S = 0.002


class NamespaceBody(BaseModel):
    namespace: dict


def create_app(settings: DirectorySettings | None = None):
    """The directory as an ASGI app: FastAPI behind the hot calls' path. `.state.service` is the
    service, `.fastapi` the framework app (routes, OpenAPI)."""
    app = create_fastapi(settings)
    fast = HotPath(app, app.state.hot)
    fast.state, fast.fastapi = app.state, app
    return fast


def create_fastapi(settings: DirectorySettings | None = None) -> FastAPI:
    settings = settings or DirectorySettings()
    if settings.migrate_on_start:
        db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)
    service = DirectoryService(db.make_sessions(engine), settings, DirectoryMetrics())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        stop = threading.Event()
        reaper = threading.Thread(target=_start_then_reap, args=(service, stop), name="reaper", daemon=True)
        reaper.start()
        yield
        stop.set()
        reaper.join(timeout=5)
        service.close()
        engine.dispose()

    sys.setswitchinterval(GIL_SWITCH_S)
    app = FastAPI(title="kvstore directory", version="1", lifespan=lifespan)
    app.state.service = service
    _add_error_handlers(app)
    app.include_router(_routes(service))
    app.state.hot = HotCalls(service)
    app.include_router(hot_routes(app.state.hot))
    document_bodies(app)
    return app


def _json(model: BaseModel) -> Response:
    """Serialize once with pydantic's encoder instead of FastAPI re-validating the answer."""
    return Response(model.model_dump_json(), media_type="application/json")


def _start_then_reap(service: DirectoryService, stop: threading.Event) -> None:
    """Build the index (readyz answers 503 until then), then reap every tick."""
    service.start()
    while not stop.wait(service.settings.reaper_interval_s):
        try:
            service.reap()
        except Exception:  # the loop must survive a bad tick (e.g. database briefly away)
            log.exception("reaper tick failed")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVStoreError)
    async def _kvstore_error(_request: Request, exc: KVStoreError):
        return JSONResponse(exc.to_body(), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
        body = KVStoreError("invalid", "request body does not match the schema", errors=errors).to_body()
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(KVStoreError("internal", type(exc).__name__).to_body(), status_code=500)


def _routes(service: DirectoryService) -> APIRouter:
    r = APIRouter()

    @r.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @r.get("/readyz")
    def readyz() -> Response:
        if not service.index.ready:
            return JSONResponse(KVStoreError("unavailable", "building the lookup index").to_body(), status_code=503)
        return JSONResponse({"status": "ready", "indexed_blocks": service.index.num_blocks})

    @r.get("/metrics")
    def metrics() -> Response:
        body = service.metrics.render(service.stats(), service.tiers())
        return Response(body, media_type="text/plain; version=0.0.4")

    @r.post("/v1/namespaces")
    def register_namespace(body: NamespaceBody) -> dict:
        return {"namespace_id": service.register_namespace(body.namespace)}

    @r.put("/v1/namespaces/{namespace_id}/policy")
    def set_policy(namespace_id: str, body: specs.NamespacePolicy) -> specs.NamespacePolicy:
        return service.set_policy(namespace_id, body)

    @r.post("/v1/workers")
    def register_worker(body: specs.WorkerRegistration) -> specs.Registered:
        return service.membership.register_worker(body)

    @r.post("/v1/workers/{name}/heartbeat")
    def heartbeat(name: str, body: specs.Heartbeat) -> dict:
        service.membership.heartbeat(name, body.epoch)
        return {"ok": True}

    @r.post("/v1/workers/{name}/deregister")
    def deregister(name: str, body: specs.Heartbeat) -> dict:
        service.membership.deregister(name, body.epoch)
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

    @r.post("/v1/leases/renew")
    def renew(body: specs.TokenBody) -> specs.Renewed:
        return service.store.renew(body.token)

    @r.post("/v1/store/abort")
    def abort_store(body: specs.TokenBody) -> dict:
        return {"rolled_back": service.store.abort(body.token)}

    @r.post("/v1/lookup/batch")
    def lookup_batch(body: specs.LookupBatchRequest) -> Response:
        results = [service.lookup(body.namespace_id, p) for p in body.prompts]
        return Response(wire.encode({"results": results}), media_type="application/json")

    @r.post("/v1/lookup/tokens")
    def lookup_tokens(body: specs.TokenLookupRequest) -> specs.TokenLookupResult:
        return service.lookup_tokens(body.namespace_id, body.token_ids)

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
