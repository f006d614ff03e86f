"""The base of every wire value (`kvstore.core.specs` and its neighbours): a pydantic model that is
immutable and takes no field it does not define."""

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """What every wire value is: immutable, and no field it does not define."""

    model_config = ConfigDict(frozen=True, extra="forbid")
