from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base

WRITING, READY, MOVING, DELETING = "writing", "ready", "moving", "deleting"
VISIBLE = (READY, MOVING)


class Replica(Base):
    __tablename__ = "replicas"
    __table_args__ = (Index("ix_replicas_tier_id_state", "tier_id", "state"),
                      Index("ix_replicas_state_expires_at", "state", "expires_at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # the writer numbers them
    block_id: Mapped[int] = mapped_column(ForeignKey("blocks.id", ondelete="CASCADE"), index=True)
    tier_id: Mapped[int] = mapped_column(ForeignKey("tiers.id", ondelete="CASCADE"))  # (tier_id, state) indexes it
    epoch: Mapped[int] = mapped_column(Integer)  # the worker's epoch at allocation
    state: Mapped[str] = mapped_column(String(16))  # (state, expires_at) indexes it
    token: Mapped[str] = mapped_column(String(64))  # reservation (ownership) token; asked for with state WRITING,
    # whose index finds it (migration 0011)
    pages: Mapped[list] = mapped_column(JSON)  # [[first_page, count], ...]
    reserved_bytes: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # WRITING only
    created_at: Mapped[float] = mapped_column(Float)
