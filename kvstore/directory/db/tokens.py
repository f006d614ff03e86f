"""The credentials' rows: tokens by digest (the secret itself is never stored)."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kvstore.directory.db.models import TokenRow

Duplicate = IntegrityError  # raised by the commit when another directory stored the same digest just now


def live(session: Session) -> list[TokenRow]:
    return session.query(TokenRow).filter(TokenRow.revoked_at.is_(None)).all()


def digest_seen(session: Session, digest: str) -> bool:
    return session.query(TokenRow.id).filter(TokenRow.digest == digest).first() is not None


def token(session: Session, token_id: str) -> TokenRow | None:
    return session.get(TokenRow, token_id)


def every(session: Session) -> list[TokenRow]:
    return session.query(TokenRow).order_by(TokenRow.created_at).all()


def add(session: Session, row: TokenRow) -> None:
    session.add(row)
