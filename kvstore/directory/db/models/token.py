from sqlalchemy import JSON, Float, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class TokenRow(Base):
    """A bearer credential. Only the SHA-256 of the secret is kept; the secret is shown once."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # public: names the token in list/revoke
    name: Mapped[str] = mapped_column(String(200))
    digest: Mapped[str] = mapped_column(String(64), unique=True)  # hex SHA-256 of the secret
    scopes: Mapped[list] = mapped_column(JSON)  # of engine / worker / admin / read
    tenants: Mapped[list] = mapped_column(JSON)  # an engine token's tenants
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
