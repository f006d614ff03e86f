from sqlalchemy import BigInteger, Boolean, Float, Integer, Text
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base

CHANGE_ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite numbers only INTEGER primary keys


class Change(Base):
    """One group commit of the leader: what the other replicas' lookup indexes must read again."""

    __tablename__ = "changes"

    id: Mapped[int] = mapped_column(CHANGE_ID, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    blocks: Mapped[str] = mapped_column(Text, default="")  # block ids, comma-separated
    topology: Mapped[bool] = mapped_column(Boolean, default=False)  # workers or tiers changed
    namespaces: Mapped[bool] = mapped_column(Boolean, default=False)  # a namespace was added or changed
    handoffs: Mapped[str] = mapped_column(Text, default="", server_default="")  # "<namespace>/<id>", comma-separated
