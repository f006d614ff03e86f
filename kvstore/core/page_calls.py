"""The wire values of the directory's page calls to a worker's control endpoint: reserve pages for
blocks (`AllocRequest`), take page credit of a memory tier (`GrantRequest`), and give pages or S3
objects back (`FreeRequest`). Pydantic models, like the rest of `kvstore.core.specs`."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvstore.core.spec_base import Spec
from kvstore.core.specs import MAX_BLOCKS, BlockBytes, PageRun, TierKind

MAX_FREE_ITEMS = 10_000  # allocations one free call gives back (the directory sends larger sets in chunks)
MAX_GRANT_PAGES = 1 << 40  # far above any tier's page count: a bound, not a policy


class AllocRequest(Spec):
    """Directory -> worker: reserve pages for each size, all-or-nothing per item."""

    token: str = Field(min_length=1, max_length=64)
    kind: TierKind
    sizes: list[BlockBytes] = Field(max_length=MAX_BLOCKS)


class AllocResult(Spec):
    runs: list[list[PageRun] | None]


class GrantRequest(Spec):
    """Directory -> worker: page credit, up to `max_pages` free pages of a memory tier at once."""

    token: str = Field(min_length=1, max_length=64)
    kind: TierKind
    max_pages: int = Field(gt=0, le=MAX_GRANT_PAGES)


class GrantResult(Spec):
    runs: list[PageRun]


class FreeItem(Spec):
    token: str = Field(max_length=64)
    runs: list[PageRun] = Field(max_length=1 << 16)
    object: str | None = Field(None, pattern=r"^[0-9a-f]{1,64}/[0-9a-f]{2,128}$", description="s3: '<ns_id>/<hash>'")
    all_pages: bool = Field(False, exclude_if=lambda v: not v, description="every NVMe page the token holds (runs "
                            "empty): the destinations of a move whose answer the directory lost, and so never "
                            "learnt their pages; written only when true")

    @model_validator(mode="after")
    def _whole_token(self) -> FreeItem:
        if self.all_pages and (self.runs or self.object is not None):
            raise ValueError("all_pages frees what the token holds: no runs and no object with it")
        return self


class FreeRequest(Spec):
    items: list[FreeItem] = Field(max_length=MAX_FREE_ITEMS)
