"""Directory settings: CLI flags, then `KVSTORE_*` environment variables, then the config file's
`[directory]` table (kvstore.core.config), then these defaults."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstore.core import config, tiers
from kvstore.core.errors import KVStoreError
from kvstore.policies import (DEFAULT_ADMISSION, DEFAULT_ADMISSION_BY_TIER, DEFAULT_EVICTION, make_admission,
                              make_eviction)

TIER_KINDS = tiers.ORDER


class DirectorySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_", frozen=True)

    database_url: str = Field("sqlite:///var/directory.db", description="any SQLAlchemy URL")
    lease_ttl_s: float = Field(30.0, gt=0, le=3600, description="reader pins expire after this")
    reservation_ttl_s: float = Field(30.0, gt=0, le=3600, description="uncompleted stores roll back after this")
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60, description="what workers are told to use")
    heartbeat_timeout_s: float = Field(10.0, gt=0, le=600, description="silence after which a worker is dead")
    reaper_interval_s: float = Field(0.5, gt=0, le=60, description="seconds between rounds of expiry, dead-worker "
                                     "detection and tier moves")
    move_timeout_s: float = Field(300.0, gt=0, le=3600, description="a worker must finish a batch of tier "
                                  "moves within this; its destinations stay reserved that long (and no longer)")
    require_auth: bool = Field(True, description="every route but /healthz and /readyz needs a bearer token")
    open_metrics: bool = Field(False, description="serve /metrics without a token")
    engine_rate: float = Field(10_000.0, ge=0, description="requests/s of one engine token; 0 = no limit")
    engine_burst: float = Field(20_000.0, ge=1, description="requests an engine token may send at once")
    verify_writes: bool = Field(False, description="a worker checksums every block at commit; a block whose bytes "
                                "do not match its writer's checksum is not committed")
    relaxed_commits: bool = Field(False, description="PostgreSQL: a save's commit does not wait for the database "
                                  "to flush it, nor for a synchronous standby (synchronous_commit off); a database "
                                  "crash loses the saves of its last moments (up to 3 x wal_writer_delay: 0.6 s by "
                                  "default) as misses, and after any database restart the directory reads its "
                                  "state from SQL again")
    ca_file: str | None = Field(None, description="CA bundle that workers' HTTPS certificates are checked against")
    advertise_url: str | None = Field(None, max_length=512, pattern=r"^https?://[^/\s]+$",
                                      description="URL the other directory replicas on the same PostgreSQL database "
                                      "send calls to while this one leads (default: http(s)://HOST:PORT of the "
                                      "serve command)")
    migrate_on_start: bool = Field(True, description="run alembic upgrade head at start-up")
    eviction: str = Field(DEFAULT_EVICTION, description="eviction policy of every tier (kvstore/policies)")
    admission: str = Field(DEFAULT_ADMISSION, description="admission of the memory tiers (and of NVMe/S3 where "
                           "admission_by_tier does not say): a name, size:MIN-MAX, or a comma-separated chain")
    eviction_by_tier: dict[str, str] = Field(default_factory=dict, description='overrides, e.g. {"s3": "lru"}')
    admission_by_tier: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ADMISSION_BY_TIER),
                                              description='overrides; default: NVMe and S3 keep every demoted block')
    eviction_order: Literal["child", "directory"] = Field(
        "child", description="where the tiers' eviction orders live: child = a process of their own, which "
        "builds them from SQL and walks them for dry runs while the directory answers lookups (SQL's "
        "least-recently-used order while it is not running); directory = the directory's own process")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return config.sources(settings_cls, init_settings, env_settings, "directory")

    @field_validator("eviction_by_tier", "admission_by_tier")
    @classmethod
    def _known_tiers(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(TIER_KINDS))
        if unknown:
            raise ValueError(f"unknown tier kinds {unknown}; choose from {list(TIER_KINDS)}")
        return value

    @field_validator("advertise_url")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).hostname in ("0.0.0.0", "::", ""):
            raise ValueError(f"{value}: other replicas cannot call a wildcard address; name this host")
        return value

    @model_validator(mode="after")
    def _known_policies(self) -> DirectorySettings:
        try:
            for kind in TIER_KINDS:
                make_eviction(self.tier_eviction()[kind], 1)
                make_admission(self.tier_admission()[kind], 1)
        except KVStoreError as exc:
            raise ValueError(exc.message) from None
        return self

    def tier_eviction(self) -> dict[str, str]:
        return {kind: self.eviction_by_tier.get(kind, self.eviction) for kind in TIER_KINDS}

    def tier_admission(self) -> dict[str, str]:
        return {kind: self.admission_by_tier.get(kind, self.admission) for kind in TIER_KINDS}
