"""Worker-pushed loads: a storage worker WRITEs leased blocks into an engine's registered memory.

Over a transport whose one-sided READ is slower than its WRITE (UCX over TCP), an engine on
another host asks the worker to push instead of reading. The directory signs what it leased:

    key = engine_key(secret, worker, epoch, tenant, owner, reader)      # the engine's registration there
    grant = lease_grant(secret, worker, epoch, tenant, owner, reader, token, expires_at, runs)

`secret` is the control secret the worker registered with, so only the directory can sign and
only that worker can check. `owner` is the id of the credential the engine called with ('' when
the directory runs without credentials): engines that share a credential trust each other, no
other engine can register under, push into or forget another's memory. `runs` are the lease's
(address, length) runs on that worker, in the order of the prepared hits; a grant names them
and nothing else, until the lease's first expiry (the worker does not learn that a lease was
released earlier: what it guards is which engine memory is written, not which arena bytes an
engine may see, which NIXL READs reach anyway). The engine sends `PushRequest`s with its NIXL
metadata whenever its registered memory changed (a higher `generation`); a worker never writes
under a generation older than the newest it has seen for that engine, and `ForgetEngine` (sent
before the engine deregisters memory) answers once no push into the old memory runs.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Annotated, Literal

from pydantic import Field

from kvstore.core.keys import MAX_NAME_CHARS
from kvstore.core.spec_base import Spec

MAX_PUSH_RUNS = 8192  # runs one lease may grant on one worker; a larger load is read
MAX_METADATA_CHARS = 256 << 10  # base64 of an engine's NIXL metadata (~44 bytes a registered region)
MAX_GENERATION = 1 << 62
MAX_WAIT_S = 60.0  # the longest one push may take
HEX_MAC = r"^[0-9a-f]{64}$"
Address = Annotated[int, Field(ge=0, lt=1 << 64)]
Run = tuple[Address, Annotated[int, Field(gt=0, le=1 << 40)]]
Item = tuple[Annotated[int, Field(ge=0, lt=MAX_PUSH_RUNS)], Annotated[int, Field(gt=0, lt=1 << 64)]]
Owner = Annotated[str, Field(max_length=64)]
Reader = Annotated[str, Field(min_length=1, max_length=200)]
Epoch = Annotated[int, Field(ge=0, lt=1 << 63)]


class PushGrant(Spec):
    """What prepare_load hands an engine that asked for pushes, per worker holding its DRAM hits."""

    worker: str
    epoch: Epoch
    control_url: str
    owner: Owner = Field(description="the id of the credential the engine called with")
    expires_at: float
    grant: str = Field(pattern=HEX_MAC)
    engine_key: str = Field(pattern=HEX_MAC)


class EngineMemory(Spec):
    generation: int = Field(ge=0, le=MAX_GENERATION, description="grows whenever the engine registers or "
                            "releases memory")
    metadata: str | None = Field(None, max_length=MAX_METADATA_CHARS,
                                 description="base64 NIXL agent metadata: sent when the worker asks for it")


class PushRequest(Spec):
    tenant: str = Field(max_length=MAX_NAME_CHARS)
    owner: Owner
    reader: Reader
    epoch: Epoch
    token: str = Field(max_length=64)
    expires_at: float
    runs: list[Run] = Field(max_length=MAX_PUSH_RUNS, description="every run the grant names")
    grant: str = Field(pattern=HEX_MAC)
    engine_key: str = Field(pattern=HEX_MAC)
    engine: EngineMemory
    items: list[Item] = Field(min_length=1, max_length=MAX_PUSH_RUNS,
                              description="(index into runs, engine address it goes to)")
    wait_s: float = Field(30.0, gt=0, le=MAX_WAIT_S, description="the longest the push may take; then it fails")


class PushResult(Spec):
    code: Literal["ok", "metadata", "stale", "failed"]
    error: str | None = None


class ForgotEngine(Spec):
    quiet: bool = Field(description="no push into the engine's older memory ran when the answer left")


class ForgetEngine(Spec):
    tenant: str = Field(max_length=MAX_NAME_CHARS)
    owner: Owner
    reader: Reader
    epoch: Epoch
    engine_key: str = Field(pattern=HEX_MAC)
    generation: int = Field(ge=0, le=MAX_GENERATION, description="pushes under an older generation are "
                            "refused from now on")


def engine_key(secret: str, worker: str, epoch: int, tenant: str, owner: str, reader: str) -> str:
    return _mac(secret, b"engine", worker, str(epoch), tenant, owner, reader)


def lease_grant(secret: str, worker: str, epoch: int, tenant: str, owner: str, reader: str, token: str,
                expires_at: float, runs: list[tuple[int, int]]) -> str:
    digest = hashlib.sha256(b"".join(struct.pack("<QQ", int(a), int(n)) for a, n in runs)).hexdigest()
    return _mac(secret, b"lease", worker, str(epoch), tenant, owner, reader, token, repr(float(expires_at)), digest)


def same(mac: str, expected: str) -> bool:
    return hmac.compare_digest(mac.encode(), expected.encode())


def _mac(secret: str, kind: bytes, *fields: str) -> str:
    message = kind + b"".join(struct.pack("<I", len(f.encode())) + f.encode() for f in fields)  # unambiguous
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
