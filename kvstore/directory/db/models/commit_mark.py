from sqlalchemy import Float, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class CommitMark(Base):
    """One row per group commit of the writer, written in its transaction: when a COMMIT's answer is
    lost (the connection dropped), whether the row is there says whether the group committed."""

    __tablename__ = "commit_marks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    at: Mapped[float] = mapped_column(Float, index=True)
