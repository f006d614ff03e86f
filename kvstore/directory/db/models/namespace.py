from sqlalchemy import JSON, Boolean, Float, Integer, String, false, text
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class NamespaceRow(Base):
    __tablename__ = "namespaces"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # namespace_id
    spec: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    write_through: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)  # copy to S3
    replicas: Mapped[int] = mapped_column(Integer, server_default=text("1"), default=1)  # workers per block
