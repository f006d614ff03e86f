import pytest

from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import format_size, parse_size


@pytest.mark.parametrize("text,value", [("4096", 4096), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29),
                                        ("2GB", 2_000_000_000), ("64 KiB", 65536), ("1kb", 1000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-5", "1e9"])
def test_parse_size_refuses_garbage(text):
    with pytest.raises(KVStoreError, match="cannot read"):
        parse_size(text)


def test_format_size():
    assert format_size(512 << 20) == "512.0 MiB"
    assert format_size(10) == "10 B"
    assert format_size(None) == "unbounded"


def test_error_body_round_trip():
    error = KVStoreError("conflict", "stale epoch", worker="w", epoch=3)
    again = KVStoreError.from_body(error.to_body())
    assert (again.kind, again.message, again.context) == ("conflict", "stale epoch", {"worker": "w", "epoch": 3})
    assert error.http_status == 409


def test_unknown_kinds_are_a_bug():
    with pytest.raises(AssertionError):
        KVStoreError("oops", "no such kind")
