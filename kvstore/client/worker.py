"""Typed client of a storage worker's control endpoint (directory -> worker)."""

from __future__ import annotations

from kvstore.client.http import JsonHttp
from kvstore.core import moving, page_calls


class WorkerControlClient(JsonHttp):
    def allocate(self, body: page_calls.AllocRequest) -> page_calls.AllocResult:
        return self.call("POST", "/v1/alloc", body, page_calls.AllocResult)

    def free(self, body: page_calls.FreeRequest) -> None:
        self.call_raw("POST", "/v1/free", body)

    def grant(self, body: page_calls.GrantRequest) -> page_calls.GrantResult:
        return self.call("POST", "/v1/grant", body, page_calls.GrantResult)

    def move(self, body: moving.MoveRequest, timeout_s: float | None = None) -> moving.MoveResult:
        return self.call("POST", "/v1/move", body, moving.MoveResult, timeout_s)

    def verify(self, body: moving.VerifyRequest) -> moving.VerifyResult:
        return self.call("POST", "/v1/verify", body, moving.VerifyResult)

    def fence(self, body: moving.FenceRequest, timeout_s: float | None = None) -> moving.FenceResult:
        return self.call("POST", "/v1/fence", body, moving.FenceResult, timeout_s)
