"""Directory settings: `KVSTORE_*` environment variables or CLI flags."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DirectorySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_", frozen=True)

    database_url: str = Field("sqlite:///var/directory.db", description="any SQLAlchemy URL")
    lease_ttl_s: float = Field(30.0, gt=0, le=3600, description="reader pins expire after this")
    reservation_ttl_s: float = Field(30.0, gt=0, le=3600, description="uncompleted stores roll back after this")
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60, description="what workers are told to use")
    heartbeat_timeout_s: float = Field(10.0, gt=0, le=600, description="silence after which a worker is dead")
    reaper_interval_s: float = Field(0.5, gt=0, le=60)
    migrate_on_start: bool = Field(True, description="run alembic upgrade head at start-up")
