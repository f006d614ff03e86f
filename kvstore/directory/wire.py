"""The hot calls' bodies, decoded and validated by msgspec (no model per block).

The same fields and bounds as the pydantic specs in `kvstore.core.specs`, which
stay the documented schema (OpenAPI) and what clients build. `decode` turns a
bad body into the directory's 400.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from kvstore.core.errors import KVStoreError

Hash = Annotated[str, Meta(pattern=r"^[0-9a-f]{2,128}$")]
# In lists of hashes the digits are checked once for the whole list (`_hex_only`): a pattern per
# string costs a 128-block lookup more than the lookup itself.
HashInList = Annotated[str, Meta(min_length=2, max_length=128)]
HEX_DIGITS = b"0123456789abcdef"
Checksum = Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{16}$")]
Token = Annotated[str, Meta(max_length=64)]
NamespaceId = Annotated[str, Meta(max_length=16)]
Reader = Annotated[str, Meta(max_length=200)]
MAX_HASHES = 100_000
T = TypeVar("T")


class _Body(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class Lookup(_Body):
    namespace_id: NamespaceId
    hashes: Annotated[list[HashInList], Meta(max_length=MAX_HASHES)]
    locations: bool = False


class BlockToStore(_Body):
    hash: Hash
    nbytes: Annotated[int, Meta(gt=0)]
    parent: Hash | None = None


class PrepareStore(_Body):
    namespace_id: NamespaceId
    blocks: Annotated[list[BlockToStore], Meta(min_length=1, max_length=MAX_HASHES)]
    writer: Reader = ""


class BlockWritten(_Body):
    hash: Hash
    ok: bool
    checksum: Checksum | None = None


class CompleteStore(_Body):
    token: Token
    blocks: Annotated[list[BlockWritten], Meta(max_length=MAX_HASHES)]


class PrepareLoad(_Body):
    namespace_id: NamespaceId
    hashes: Annotated[list[HashInList], Meta(max_length=MAX_HASHES)]
    reader: Reader = ""


class PrepareLoads(_Body):
    namespace_id: NamespaceId
    chains: Annotated[list[list[HashInList]], Meta(max_length=4096)]
    reader: Reader = ""


class BlockRead(_Body):
    hash: Hash
    ok: bool


class CompleteLoad(_Body):
    token: Token
    blocks: Annotated[list[BlockRead], Meta(max_length=MAX_HASHES)] = []


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, kind: type[T]) -> T:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        value = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise KVStoreError("invalid", "request body does not match the schema", errors=[str(exc)]) from None
    except msgspec.DecodeError as exc:
        raise KVStoreError("invalid", "request body is not valid JSON", errors=[str(exc)]) from None
    if isinstance(value, PrepareLoads):
        if sum(len(c) for c in value.chains) > MAX_HASHES:
            raise KVStoreError("invalid", f"at most {MAX_HASHES} hashes in all chains together")
        _hex_only([h for c in value.chains for h in c])
    elif isinstance(value, (Lookup, PrepareLoad)):
        _hex_only(value.hashes)
    return value


def _hex_only(hashes: list[str]) -> None:
    """Every hash is lowercase hex: deleting the digits from the joined list leaves nothing (a
    table lookup per byte in C)."""
    if "".join(hashes).encode().translate(None, HEX_DIGITS):
        bad = next(h for h in hashes if h.encode().translate(None, HEX_DIGITS))
        raise KVStoreError("invalid", "request body does not match the schema",
                           errors=[f"hash {bad[:140]!r} is not 2-128 lowercase hex digits"])


encode = msgspec.json.Encoder().encode
