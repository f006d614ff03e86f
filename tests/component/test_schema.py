"""Migrations on a populated database, on SQLite and PostgreSQL alike (the unit tests run SQLite alone)."""

from __future__ import annotations

from tests.unit.test_migrations import round_trip_0010


def test_0010_round_trip_keeps_every_replica(database_url):
    round_trip_0010(database_url)
