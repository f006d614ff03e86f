from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class Tier(Base):
    __tablename__ = "tiers"
    __table_args__ = (UniqueConstraint("worker_id", "kind"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))  # hbm / dram / nvme / s3
    capacity_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    used_bytes: Mapped[int] = mapped_column(BigInteger)
    page_bytes: Mapped[int] = mapped_column(BigInteger)
    base_addr: Mapped[int] = mapped_column(BigInteger)
    device: Mapped[int] = mapped_column(Integer, server_default="0", default=0)  # an HBM tier's CUDA device
    high_watermark: Mapped[float] = mapped_column(Float)
    low_watermark: Mapped[float] = mapped_column(Float)
