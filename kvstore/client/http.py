"""JSON over HTTP with kvstore's error bodies turned back into KVStoreError."""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel

from kvstore.core.errors import KVStoreError

M = TypeVar("M", bound=BaseModel)


class JsonHttp:
    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def call(self, method: str, path: str, body: BaseModel | None, answer: type[M]) -> M:
        return answer.model_validate(self.call_raw(method, path, body))

    def call_raw(self, method: str, path: str, body: BaseModel | dict | None = None):
        if isinstance(body, BaseModel):
            body = body.model_dump(mode="json")
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise KVStoreError(
                "unavailable", f"cannot reach {self.base_url}: {exc}", url=self.base_url + path
            ) from None
        if response.is_success:
            return response.json()
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if isinstance(payload, dict) and "error" in payload:
            raise KVStoreError.from_body(payload)
        raise KVStoreError(
            "internal", f"HTTP {response.status_code} from {self.base_url}{path}",
            body=response.text[:500],
        )

    def close(self) -> None:
        self._http.close()
