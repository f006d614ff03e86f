"""What a prefill engine and a decode engine say to the directory about a hand-off.

A hand-off is the KV of one prompt that a producer (prefill) saves for a consumer (decode). Its
id is the router's choice, sent to both; it lives in the namespace both engines use, so another
namespace's (another tenant's, another model's) hand-off of the same id is another hand-off.

    POST /v1/handoffs       HandoffCommit -> HandoffState    # the producer: every save has committed
    POST /v1/handoffs/wait  HandoffWait   -> HandoffState    # the consumer: until committed, or its
                                                             # blocks are all there, or timeout_s
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvstore.core.spec_base import Spec
from kvstore.core.specs import HexHash

HANDOFF_ID = r"^[A-Za-z0-9._:-]{1,128}$"
HandoffId = Annotated[str, Field(pattern=HANDOFF_ID, description="chosen by the router: letters, digits, . _ : -")]
MAX_WAIT_S = 10.0  # one wait call at most; a consumer that waits longer asks again
MAX_TOKENS = 1 << 24
MAX_WAIT_BLOCKS = 32_768  # blocks a wait names (a 512k-token prompt of 16-token blocks)


class HandoffCommit(Spec):
    namespace_id: str = Field(max_length=16)
    handoff_id: HandoffId
    num_tokens: int = Field(ge=0, le=MAX_TOKENS, description="the prompt tokens the producer saved")
    failed: bool = Field(False, description="the producer gave up: consumers stop waiting and compute")
    finished_at: float | None = Field(None, ge=0, le=1e11, allow_inf_nan=False, description="unix time the "
                                      "producer's request finished (for the hand-off latency; the producer's clock)")


class HandoffWait(Spec):
    namespace_id: str = Field(max_length=16)
    handoff_id: HandoffId
    hashes: list[HexHash] = Field([], max_length=MAX_WAIT_BLOCKS, description="the consumer's blocks: the wait also "
                                  "ends once every one of them is stored (a commit that was lost)")
    timeout_s: float = Field(MAX_WAIT_S, ge=0, le=MAX_WAIT_S)


HandoffOutcome = Literal["committed", "failed", "present", "pending"]


class HandoffState(Spec):
    handoff_id: str
    state: HandoffOutcome = Field(description="committed / failed: what the producer said; present: not said, "
                                  "but every block named is stored; pending: none of these yet")
    num_tokens: int | None = None
    committed_at: float | None = None
    waited_s: float = 0.0
