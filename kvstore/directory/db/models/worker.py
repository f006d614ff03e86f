from sqlalchemy import JSON, Float, Integer, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from kvstore.directory.db.models.base import Base


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    agent_name: Mapped[str] = mapped_column(String(200))
    agent_metadata: Mapped[bytes] = mapped_column(LargeBinary)
    epoch: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))  # active / draining / dead
    pid: Mapped[int] = mapped_column(Integer)
    control_url: Mapped[str] = mapped_column(String(500))
    backends: Mapped[list] = mapped_column(JSON)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    registered_at: Mapped[float] = mapped_column(Float)
    owner: Mapped[str] = mapped_column(String(64), default="")  # id of the token that registered it ('' = none)
    control_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)  # the directory's calls carry it
