"""Fixtures of the integration suite: one real multi-process LocalCluster for the session.

Where it runs: the test process (the client). Run the suite with
``PYTHONPATH=. .venv/bin/pytest integration -m integration``; sizes scale with
``RECHUNK_P2P_BENCH_SIZE`` / ``RECHUNK_P2P_BENCH_SCALE`` (see ``integration/workloads.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

from integration.workloads import size_from_env

N_WORKERS = 2
THREADS_PER_WORKER = 1


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "integration: event-loop latency and workload tests on a real multi-process cluster",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def sizes() -> dict[str, int]:
    """Bytes per workload, from the environment."""
    return size_from_env()


@pytest.fixture(scope="session")
def local_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the workers keep spilled data (so the suite can check it is emptied)."""
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="session")
def client(local_directory: Path) -> Iterator[Client]:
    """2 worker processes with 1 thread each; every setting at its default."""
    with (
        LocalCluster(
            n_workers=N_WORKERS,
            threads_per_worker=THREADS_PER_WORKER,
            processes=True,
            dashboard_address=":0",
            local_directory=str(local_directory),
        ) as cluster,
        Client(cluster) as c,
    ):
        yield c
