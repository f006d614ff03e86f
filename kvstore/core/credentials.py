"""Scoped bearer tokens as they travel: the scope names and the token calls' bodies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from kvstore.core.keys import MAX_NAME_CHARS
from kvstore.core.spec_base import Spec

ENGINE, WORKER, ADMIN, READ = "engine", "worker", "admin", "read"
SCOPES = (ENGINE, WORKER, ADMIN, READ)
Scope = Literal["engine", "worker", "admin", "read"]
Tenant = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
TOKEN_PATTERN = r"^kvs_[A-Za-z0-9_-]{43}$"  # "kvs_" and 256 random bits, URL-safe base64


class TokenCreate(Spec):
    """An engine token names at least one tenant; tokens of other scopes name none."""

    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"scopes": {"contains": {"const": "engine"}}}},
        "then": {"required": ["tenants"], "properties": {"tenants": {"minItems": 1}}},
        "else": {"properties": {"tenants": {"maxItems": 0}}}})

    name: str = Field(min_length=1, max_length=200, description="what the token is for")
    scopes: list[Scope] = Field(min_length=1, max_length=4)
    tenants: list[Tenant] = Field([], max_length=1000, description="an engine token's tenants (at least one)")


class TokenInfo(Spec):
    id: str
    name: str
    scopes: list[str]
    tenants: list[str]
    created_at: float
    revoked_at: float | None = None


class TokenCreated(Spec):
    token: str = Field(description="the secret; shown once, kept only as a hash")
    info: TokenInfo
