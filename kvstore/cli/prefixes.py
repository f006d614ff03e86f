"""`kvstore lookup` and `kvstore inspect`: what the store holds of one prompt."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kvstore.cli.common import DEFAULT_URL, CaFile, Output, Token, Url, ago, directory, emit, one_line_errors
from kvstore.core.errors import KVStoreError
from kvstore.core.inspection import InspectRequest
from kvstore.core.sizes import format_size

TokenIds = Annotated[str | None, typer.Argument(help="comma-separated token ids of the prompt")]
HashSeed = Annotated[str | None, typer.Option(envvar="KVSTORE_HASH_SEED", help="vLLM namespaces: the engines' "
                                              "PYTHONHASHSEED, if they set one")]


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise KVStoreError("invalid", "token ids must be comma-separated integers, e.g. 1,2,3") from None


@one_line_errors
def lookup(namespace_id: str, token_ids: Annotated[str, typer.Argument(help="comma-separated token ids")],
           hash_seed: HashSeed = None, url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None,
           output: Output = "table") -> None:
    """How many leading tokens of a prompt the store holds (hashed with the namespace's own scheme,
    vLLM's included)."""
    tokens = _token_ids(token_ids)
    result = directory(url, token, ca_file).lookup_tokens(namespace_id, tokens, hash_seed)
    full = len(tokens) // result.block_tokens
    emit(output, result, text=f"{result.hit_tokens} of {len(tokens)} tokens stored: {result.num_hit_blocks} of "
                              f"{full} full blocks of {result.block_tokens} tokens")


@one_line_errors
def inspect(namespace_id: str, token_ids: TokenIds = None,
            hashes: Annotated[str | None, typer.Option(help="comma-separated block hashes instead of token ids")]
            = None, hash_seed: HashSeed = None, url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None,
            output: Output = "table") -> None:
    """A prompt's blocks: stored or not, and each replica's tier, worker, state and pins."""
    if (token_ids is None) == (hashes is None):
        raise KVStoreError("invalid", "give the prompt's token ids or --hashes, not both")
    req = InspectRequest(namespace_id=namespace_id, hash_seed=hash_seed,
                         token_ids=_token_ids(token_ids) if token_ids is not None else None,
                         hashes=[h.strip() for h in hashes.split(",") if h.strip()] if hashes is not None else None)
    result = directory(url, token, ca_file).inspect(req)

    def table() -> Table:
        t = Table("block", "hash", "size", "hits", "last access", "replicas (tier@worker state pins)",
                  title=f"namespace {result.namespace_id}, {result.block_tokens} tokens per block")
        for b in result.blocks:
            where = ", ".join(f"{r.tier}@{r.worker} {r.state}" + (f" {r.pins} pins" if r.pins else "")
                              for r in b.replicas)
            t.add_row(str(b.position), b.hash[:16], format_size(b.nbytes) if b.stored else "-",
                      str(b.hit_count) if b.stored else "-", ago(b.last_access) if b.stored else "-",
                      where if b.stored else "not stored")
        return t
    emit(output, result, table)
