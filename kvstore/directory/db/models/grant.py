from sqlalchemy import JSON, Float, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class Grant(Base):
    """Pages of a worker's memory tier that the worker handed to the directory in one call (page
    credit): the directory places blocks there without asking the worker. Void in a later epoch."""

    __tablename__ = "grants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tier_id: Mapped[int] = mapped_column(ForeignKey("tiers.id", ondelete="CASCADE"), index=True)
    epoch: Mapped[int] = mapped_column(Integer)  # the worker's epoch when it granted them
    token: Mapped[str] = mapped_column(String(64))  # what the worker's allocator tagged them with
    runs: Mapped[list] = mapped_column(JSON)  # [[first_page, count], ...]
    created_at: Mapped[float] = mapped_column(Float)
