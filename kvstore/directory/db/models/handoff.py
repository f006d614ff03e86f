from sqlalchemy import Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class HandoffRow(Base):
    """A producer's word that a hand-off's saves have committed (or that it gave up), kept a while."""

    __tablename__ = "handoffs"

    namespace_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    handoff_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))  # committed / failed
    num_tokens: Mapped[int] = mapped_column(Integer)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # the producer's clock
    committed_at: Mapped[float] = mapped_column(Float, index=True)
