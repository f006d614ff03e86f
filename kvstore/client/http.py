"""JSON over HTTP with kvstore's error bodies turned back into KVStoreError."""

from __future__ import annotations

import json
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

    def call(self, method: str, path: str, body: BaseModel | None, answer: type[M],
             timeout_s: float | None = None) -> M:
        return answer.model_validate_json(self._request(method, path, body, timeout_s).content)

    def call_raw(self, method: str, path: str, body: BaseModel | dict | None = None):
        return self._request(method, path, body).json()

    def _request(self, method: str, path: str, body: BaseModel | dict | None,
                 timeout_s: float | None = None) -> httpx.Response:
        if isinstance(body, BaseModel):
            content, headers = body.model_dump_json().encode(), {"content-type": "application/json"}
        else:
            content, headers = (json.dumps(body).encode(), {"content-type": "application/json"}) if body else (None, {})
        try:
            extra = {"timeout": timeout_s} if timeout_s is not None else {}
            response = self._http.request(method, path, content=content, headers=headers, **extra)
        except httpx.HTTPError as exc:
            raise KVStoreError(
                "unavailable", f"cannot reach {self.base_url}: {exc}", url=self.base_url + path
            ) from None
        if response.is_success:
            return response
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
