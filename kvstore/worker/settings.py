"""Worker settings: CLI flags, then `KVSTORE_WORKER_*` environment variables, then the config
file's `[worker]` table (kvstore.core.config), then these defaults. Sizes take units ("2GiB")."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstore.core import config
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import parse_size

GENERIC = {"token": "KVSTORE_TOKEN", "ca_file": "KVSTORE_CA_FILE"}  # what every kvstore command reads, as a fallback


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_WORKER_", frozen=True)

    directory_url: str = Field("http://127.0.0.1:8700", description="the directory this worker registers with "
                               "(several URLs, comma-separated, are tried in turn)")
    name: str = Field(default_factory=lambda: f"worker-{socket.gethostname()}", min_length=1,
                      description="unique among the directory's workers")
    host: str = Field("127.0.0.1", description="address the control endpoint binds (and registers, unless "
                      "advertise_host is set)")
    advertise_host: str | None = Field(None, min_length=1, max_length=255, description="address the directory "
                                       "calls this worker at, when it differs from host (host 0.0.0.0, NAT)")
    port: int = Field(0, ge=0, le=65535, description="control endpoint port; 0 = any free port")
    dram_bytes: int = Field(512 << 20, ge=1 << 20, description="DRAM arena size, allocated and registered once")
    page_bytes: int = Field(4 << 10, ge=4096, le=1 << 30, description="page size of every tier (a block takes "
                            "whole pages; an NVMe directory keeps the page size it was created with)")
    hbm_bytes: int = Field(0, ge=0, description="HBM tier size; needs CUDA; 0 = no HBM tier")
    hbm_device: int = Field(0, ge=0, description="CUDA device of the HBM tier")
    nvme_bytes: int = Field(0, ge=0, description="NVMe tier size in slab files; 0 = no NVMe tier")
    nvme_dir: Path = Field(Path("var/nvme"), description="where the slab files and their manifest live")
    nvme_direct: Literal["auto", "on", "off"] = Field("auto", description="NVMe slabs opened with O_DIRECT (no "
                                                      "second copy in the page cache): auto = where the filesystem "
                                                      "takes it, on = refuse to start otherwise, off = never")
    posix_queue: Literal["aio", "uring"] = Field("aio", description="NIXL POSIX backend queue")
    gds: Literal["auto", "on", "off"] = Field("auto", description="HBM <-> NVMe through GDS_MT when both tiers exist: "
                                              "auto = if cuFile loads, on = refuse to start without it")
    s3_bucket: str | None = Field(None, min_length=3, description="S3 tier bucket; None = no S3 tier")
    s3_endpoint: str | None = Field(None, description="e.g. http://127.0.0.1:9000; None = AWS")
    s3_prefix: str = Field("kvstore", description="objects live at <prefix>/<namespace_id>/<hash>")
    s3_region: str = Field("us-east-1", description="region of the S3 tier's bucket")
    s3_virtual_addressing: bool = Field(False, description="bucket.host URLs instead of host/bucket paths")
    token: str | None = Field(None, description="worker-scope token for the directory (if none is given, "
                              "KVSTORE_TOKEN's)")
    ca_file: str | None = Field(None, description="CA bundle the directory's HTTPS certificate is checked against "
                                "(if none is given, KVSTORE_CA_FILE's)")
    tls_cert: Path | None = Field(None, description="certificate of the control endpoint (HTTPS); needs tls_key")
    tls_key: Path | None = Field(None, description="private key of the control endpoint's certificate")
    bounce_bytes: int = Field(64 << 20, ge=1 << 20, description="DRAM buffer for copies to S3 (>= one block)")
    arena_dir: Path | None = Field(Path("/tmp/kvstore"), description="folder of the Unix socket <name>.sock that "
                                   "hands the DRAM arena to engines of this host and user (one copy per byte "
                                   "instead of NIXL); empty = engines use NIXL only")
    open_metrics: bool = Field(False, description="serve GET /metrics on the control port without a credential")
    metrics_token: str | None = Field(None, min_length=16, max_length=256,
                                      description="bearer token that GET /metrics accepts (for Prometheus)")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return config.sources(settings_cls, init_settings, env_settings, "worker")

    @model_validator(mode="before")
    @classmethod
    def _generic_client_settings(cls, values):
        """KVSTORE_TOKEN and KVSTORE_CA_FILE, which every kvstore command takes, when the worker's
        own setting is given nowhere (flag, KVSTORE_WORKER_..., config file)."""
        if not isinstance(values, dict):
            return values
        return {**values, **{name: os.environ[var] for name, var in GENERIC.items()
                             if values.get(name) is None and os.environ.get(var)}}

    @model_validator(mode="after")
    def _reachable(self) -> "WorkerSettings":
        if self.host in ("0.0.0.0", "::", "") and self.advertise_host is None:
            raise ValueError(f"host {self.host!r} binds every address, but the directory needs one to call: "
                             "add advertise_host (--advertise-host)")
        return self

    @model_validator(mode="after")
    def _direct_pages(self) -> "WorkerSettings":
        if self.nvme_direct == "on" and self.page_bytes % 4096:
            raise ValueError(f"nvme_direct on needs page_bytes in multiples of 4096 (O_DIRECT), not {self.page_bytes}")
        return self

    @field_validator("arena_dir", mode="before")
    @classmethod
    def _optional_dir(cls, value):
        return None if value in ("", None) else value

    @field_validator("dram_bytes", "page_bytes", "hbm_bytes", "nvme_bytes", "bounce_bytes", mode="before")
    @classmethod
    def _size(cls, value):
        if isinstance(value, str):
            try:
                return parse_size(value)
            except KVStoreError as exc:
                raise ValueError(exc.message) from None
        return value
