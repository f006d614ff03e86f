from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class Block(Base):
    """One stored block. No unique index on (namespace, hash): the leader's lookup index is the
    authority for uniqueness (a save asks it, not SQL), and a random hash's index entry was the
    dearest part of a save's INSERT. A rebuild from SQL resolves the rare duplicate rows
    (`Index.rebuild`). Ids are assigned by the writer (`direct.insert_blocks`), not by the database."""

    __tablename__ = "blocks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    namespace_id: Mapped[str] = mapped_column(ForeignKey("namespaces.id"))
    hash: Mapped[str] = mapped_column(String(128))
    parent: Mapped[str | None] = mapped_column(String(128), nullable=True)
    depth: Mapped[int] = mapped_column(Integer)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str | None] = mapped_column(String(16), nullable=True)  # set at commit
    created_at: Mapped[float] = mapped_column(Float)
    last_access: Mapped[float] = mapped_column(Float)
    hit_count: Mapped[int] = mapped_column(Integer, default=0)
