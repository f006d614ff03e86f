"""Human byte sizes: parse `512MiB`, `1.5GB`, `4096`; print `1.5 GiB`; check a request's length."""

from __future__ import annotations

import re

from kvstore.core.errors import KVStoreError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """`"512MiB"` -> 536870912. Raises KVStoreError('invalid') on anything else."""
    if isinstance(text, int):
        if text < 0:
            raise KVStoreError("invalid", "a size cannot be negative", value=text)
        return text
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise KVStoreError(
            "invalid", f"cannot read {text!r} as a size; use e.g. 4096, 64KiB, 512MiB, 2GiB",
            value=text,
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "unbounded"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def too_large(limit: int) -> KVStoreError:
    return KVStoreError("too_large", f"request body over {limit} bytes", limit=limit)


def body_length(value: str | bytes | None, limit: int) -> int | None:
    """A request's content-length header, checked: None without one; `invalid` when it is not a
    number, `too_large` when it is over `limit`."""
    if value is None:
        return None
    text = (value.decode("latin-1") if isinstance(value, bytes) else value).strip()
    if not text.isdigit():
        raise KVStoreError("invalid", f"content-length {text[:40]!r} is not a number")
    if int(text) > limit:
        raise too_large(limit)
    return int(text)
