"""dask's and distributed's own rechunk suites, run through the engine by
``python -m integration.upstream``: every test passes, and those that rechunk reach the engine.

dask's suite ships in its wheel and runs every time. distributed's is not in its wheel: it
runs when ``RECHUNK_P2P_DISTRIBUTED_SNAPSHOT`` names the git directory of a dask/distributed
snapshot, and is skipped otherwise.
"""

from __future__ import annotations

import os

import pytest

from integration.upstream import DESELECTED, run_suite

#: At least this many tests of each suite must have built a rechunk through the engine
#: (measured: dask 84 of 118 in both modes, distributed 75 of 95; the others test dask's tasks
#: algorithm or rechunk nothing).
_MIN_ROUTED = {"dask-install": 80, "dask-entry": 80, "distributed": 70}


def _check(report: dict) -> None:
    failed = [r["test"] for r in report["records"] if r["outcome"] == "failed"]
    assert not failed, report["output"]
    assert report["exit_code"] == 0, report["output"]
    routed = report["summary"].get("passed (engine ran)", 0)
    assert routed >= _MIN_ROUTED[report["suite"]], report["summary"]


@pytest.mark.parametrize("suite", ["dask-entry"])
def test_dask_suite_through_the_engine(suite):
    """dask's suite with the engine's own ``rechunk`` as dask's (install() mode: see
    tests/test_dask_compat.py, which runs it in process)."""
    _check(run_suite(suite))


@pytest.mark.skipif(
    not os.environ.get("RECHUNK_P2P_DISTRIBUTED_SNAPSHOT"),
    reason="set RECHUNK_P2P_DISTRIBUTED_SNAPSHOT to a dask/distributed git directory",
)
def test_distributed_suite_through_the_engine():
    report = run_suite("distributed", os.environ["RECHUNK_P2P_DISTRIBUTED_SNAPSHOT"])
    _check(report)
    assert report["summary"]["deselected"] == len(DESELECTED["distributed"])
