from sqlalchemy import Float, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class Lease(Base):
    """One pin of one replica by a reader; all pins of one prepare_load share a token."""

    __tablename__ = "leases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica_id: Mapped[int] = mapped_column(ForeignKey("replicas.id", ondelete="CASCADE"), index=True)
    token: Mapped[str] = mapped_column(String(64), index=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[float] = mapped_column(Float, index=True)
