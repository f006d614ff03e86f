"""The hot calls' bodies, decoded and validated by msgspec (no model per block).

The same fields and bounds as the pydantic specs in `kvstore.core.specs`, which
stay the documented schema (OpenAPI) and what clients build. `decode` turns a
bad body into the directory's 400.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from kvstore.core.errors import KVStoreError
from kvstore.core.specs import MAX_BLOCK_BYTES, MAX_BLOCKS

# Hex digits are checked once for all the hashes (and checksums) of a body, by `_digits_only`: a
# pattern per string costs a 128-block lookup more than the lookup itself.
Hash = Annotated[str, Meta(min_length=2, max_length=128)]
Checksum = Annotated[str, Meta(min_length=16, max_length=16)]
HEX_DIGITS = b"0123456789abcdef"
Token = Annotated[str, Meta(max_length=64)]
NamespaceId = Annotated[str, Meta(max_length=16)]
Reader = Annotated[str, Meta(max_length=200)]
T = TypeVar("T")


class _Body(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class Lookup(_Body):
    namespace_id: NamespaceId
    hashes: Annotated[list[Hash], Meta(max_length=MAX_BLOCKS)]
    locations: bool = False


class BlockToStore(_Body):
    hash: Hash
    nbytes: Annotated[int, Meta(gt=0, le=MAX_BLOCK_BYTES)]
    parent: Hash | None = None


class RequestHints(_Body):
    session_id: Annotated[str, Meta(max_length=256)] | None = None
    retain: Literal["turn", "session", "none"] | None = None
    priority: Annotated[int, Meta(ge=-100, le=100)] = 0


class PrepareStore(_Body):
    namespace_id: NamespaceId
    blocks: Annotated[list[BlockToStore], Meta(min_length=1, max_length=MAX_BLOCKS)]
    writer: Reader = ""
    hosts: Annotated[list[Annotated[str, Meta(max_length=255)]], Meta(max_length=16)] = []
    hints: RequestHints | None = None


class BlockWritten(_Body):
    hash: Hash
    ok: bool
    checksum: Checksum | None = None


class CompleteStore(_Body):
    token: Token
    blocks: Annotated[list[BlockWritten], Meta(max_length=MAX_BLOCKS)]


class PrepareLoad(_Body):
    namespace_id: NamespaceId
    hashes: Annotated[list[Hash], Meta(max_length=MAX_BLOCKS)]
    reader: Reader = ""
    push: bool = False


class PrepareLoads(_Body):
    namespace_id: NamespaceId
    chains: Annotated[list[list[Hash]], Meta(max_length=4096)]
    reader: Reader = ""


class BlockRead(_Body):
    hash: Hash
    ok: bool


class CompleteLoad(_Body):
    token: Token
    blocks: Annotated[list[BlockRead], Meta(max_length=MAX_BLOCKS)] = []


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, kind: type[T]) -> T:
    decoder = _decoders.get(kind)
    if decoder is None:
        # not strict: an integer may come as 5.0 (JSON Schema's "integer" allows it), as pydantic takes it
        decoder = _decoders[kind] = msgspec.json.Decoder(kind, strict=False)
    try:
        value = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise KVStoreError("invalid", "request body does not match the schema", errors=[str(exc)]) from None
    except msgspec.DecodeError as exc:
        raise KVStoreError("invalid", "request body is not valid JSON", errors=[str(exc)]) from None
    if isinstance(value, PrepareLoads):
        if sum(len(c) for c in value.chains) > MAX_BLOCKS:
            raise KVStoreError("invalid", f"at most {MAX_BLOCKS} hashes in all chains together")
        _digits_only("hash", [h for c in value.chains for h in c])
    elif isinstance(value, (Lookup, PrepareLoad)):
        _digits_only("hash", value.hashes)
    elif isinstance(value, PrepareStore):
        _digits_only("hash", [b.hash for b in value.blocks] + [b.parent for b in value.blocks if b.parent])
    elif isinstance(value, (CompleteStore, CompleteLoad)):
        _digits_only("hash", [b.hash for b in value.blocks])
        if isinstance(value, CompleteStore):
            _digits_only("checksum", [b.checksum.lower() for b in value.blocks if b.checksum is not None])
    return value


def _digits_only(what: str, values: list[str]) -> None:
    """Every value is lowercase hex digits: deleting them from the joined list leaves nothing (a
    table lookup per byte, in C)."""
    if "".join(values).encode().translate(None, HEX_DIGITS):
        bad = next(v for v in values if v.encode().translate(None, HEX_DIGITS))
        raise KVStoreError("invalid", "request body does not match the schema",
                           errors=[f"{what} {bad[:140]!r} is not made of hex digits"])


encode = msgspec.json.Encoder().encode
