from sqlalchemy import BigInteger, Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class LeaderRow(Base):
    """The one row (id 1) that says which directory replica leads: its term (raised by each new
    leader, checked by every commit of the leader's writer), the URL the other replicas forward
    writes to, and the change log's pruning point."""

    __tablename__ = "directory_leader"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    term: Mapped[int] = mapped_column(BigInteger, default=0)
    url: Mapped[str] = mapped_column(String(512), default="")
    since: Mapped[float] = mapped_column(Float, default=0.0)
    pruned_below: Mapped[int] = mapped_column(BigInteger, default=0)  # change ids below this are gone
