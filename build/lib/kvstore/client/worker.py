"""Typed client of a storage worker's control endpoint (directory -> worker)."""

from __future__ import annotations

from kvstore.client.http import JsonHttp
from kvstore.core import specs


class WorkerControlClient(JsonHttp):
    def allocate(self, body: specs.AllocRequest) -> specs.AllocResult:
        return self.call("POST", "/v1/alloc", body, specs.AllocResult)

    def free(self, body: specs.FreeRequest) -> None:
        self.call_raw("POST", "/v1/free", body)

    def grant(self, body: specs.GrantRequest) -> specs.GrantResult:
        return self.call("POST", "/v1/grant", body, specs.GrantResult)

    def move(self, body: specs.MoveRequest, timeout_s: float | None = None) -> specs.MoveResult:
        return self.call("POST", "/v1/move", body, specs.MoveResult, timeout_s)

    def verify(self, body: specs.VerifyRequest) -> specs.VerifyResult:
        return self.call("POST", "/v1/verify", body, specs.VerifyResult)
