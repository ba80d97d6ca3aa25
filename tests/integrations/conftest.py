"""Fixtures for the workflow tests: a real LocalCluster per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def p2p_client():
    """A real two-worker, multi-process LocalCluster for one test module; the default client."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, dashboard_address=":0", memory_limit="1GiB"
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client
