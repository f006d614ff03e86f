from __future__ import annotations

import pytest

from tests.helpers import PostgresCluster


@pytest.fixture(scope="session")
def postgres():
    cluster = PostgresCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    """Every directory test runs twice: on a SQLite file and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'directory.db'}"
    return request.getfixturevalue("postgres").create_database()


def pytest_sessionfinish(session, exitstatus) -> None:
    from tests.stacks import stop_engines

    stop_engines()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (HBM, GDS, UCX on VRAM) run only where CUDA exists."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: a GPU path")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
