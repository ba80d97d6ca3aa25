"""Run dask's and distributed's own rechunk test suites through the engine, and count.

Where it runs: a command-line driver (``python -m integration.upstream``) that starts pytest in
a subprocess per suite and mode, on files it copies into a temporary directory (nothing of
dask or distributed is committed here).

Suites and modes:

``dask-install``
    ``dask/array/tests/test_rechunk.py`` from the installed dask wheel, with
    :func:`rechunk_p2p.install` in effect, ``array.rechunk.method: p2p`` and a distributed
    client (two in-process workers) as the default client.
``dask-entry``
    The same suite with dask's ``rechunk`` (what ``x.rechunk`` and the suite's ``rechunk``
    call) replaced by the engine's own :func:`rechunk_p2p.rechunk` entry point.
``distributed``
    ``distributed/shuffle/tests/test_rechunk.py`` plus ``test_stress.py::test_chaos_rechunk``
    and ``::test_close_connections`` from a snapshot of dask/distributed (its tests are not in
    its wheel), with :func:`rechunk_p2p.install` in effect; the suite's own ``rechunk`` name,
    bound to dask's function when the module was imported, is pointed at the routed one. Pass
    the snapshot's git directory with ``--distributed``.

Every test's outcome is recorded with the number of rechunks the engine built for it, so a
test that passed without reaching the engine shows as such. Deselected tests are listed in
:data:`DESELECTED` with their reason: only tests that drive distributed's private classes or
assert its exact key names.

Examples
--------
python -m integration.upstream --suite dask-install --suite dask-entry
python -m integration.upstream --distributed /path/to/distributed/.git --suite distributed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

SUITES = ("dask-install", "dask-entry", "distributed")

_PRIVATE = "drives distributed's private P2P classes or functions, not a rechunk"
_KEY_NAMES = "asserts distributed's own barrier key name ('shuffle-barrier')"

#: Tests left out, per suite, each with its reason.
DESELECTED: dict[str, dict[str, str]] = {
    "dask-install": {},
    "dask-entry": {},
    "distributed": {
        "test_rechunk.py::test_lowlevel_rechunk": _PRIVATE + " (ArrayRechunkRun)",
        "test_rechunk.py::test_split_axes_1": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_split_axes_2": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_split_axes_nan": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_split_axes_nan_single": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_split_axes_nan_long": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_split_axes_with_nonzero": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_split_axes_with_zero": _PRIVATE + " (split_axes)",
        "test_rechunk.py::test_pick_worker_homogeneous_distribution": _PRIVATE
        + " (ArrayRechunkSpec.pick_worker)",
        "test_rechunk.py::test_calculate_prechunking_1d": _PRIVATE + " (_calculate_prechunking)",
        "test_rechunk.py::test_calculate_prechunking_2d": _PRIVATE + " (_calculate_prechunking)",
        "test_rechunk.py::test_calculate_prechunking_3d": _PRIVATE + " (_calculate_prechunking)",
        "test_rechunk.py::test_calculate_prechunking_concatenation": _PRIVATE
        + " (_calculate_prechunking)",
        "test_rechunk.py::test_calculate_prechunking_does_not_concatenate_object_type": _PRIVATE
        + " (_calculate_prechunking)",
        "test_rechunk.py::test_calculate_prechunking_splitting": _PRIVATE
        + " (_calculate_prechunking)",
        "test_rechunk.py::test_rechunk_in_memory_shards_dont_share_buffer": _PRIVATE
        + " (reads the buffers of distributed's shuffle extension)",
        "test_rechunk.py::test_partial_rechunk_homogeneous_distribution": _KEY_NAMES,
        "test_rechunk.py::test_partial_rechunk_taskgroups": _KEY_NAMES,
    },
}

_DISTRIBUTED_FILES = {
    "distributed/shuffle/tests/test_rechunk.py": "test_rechunk.py",
    "distributed/tests/test_stress.py": "test_stress.py",
    "distributed/shuffle/tests/utils.py": "shuffle_test_utils.py",
}
_DISTRIBUTED_ARGS = [
    "test_rechunk.py",
    "test_stress.py::test_chaos_rechunk",
    "test_stress.py::test_close_connections",
]

_CONFTEST = '''
"""Routes rechunks through rechunk_p2p for the upstream suite and counts them per test."""
import json
import os
import sys

import pytest

import rechunk_p2p
import rechunk_p2p.arrays
import rechunk_p2p.graph

MODE = os.environ["RECHUNK_P2P_UPSTREAM_MODE"]
RESULTS = os.environ["RECHUNK_P2P_UPSTREAM_RESULTS"]
_builds = [0]
_real_build = rechunk_p2p.graph.build_rechunk


def _counting_build(*args, **kwargs):
    _builds[0] += 1
    return _real_build(*args, **kwargs)


rechunk_p2p.graph.build_rechunk = _counting_build
rechunk_p2p.arrays.build_rechunk = _counting_build

if MODE == "distributed":
    import importlib.util

    here = os.path.dirname(__file__)
    spec = importlib.util.spec_from_file_location(
        "distributed.shuffle.tests.utils", os.path.join(here, "shuffle_test_utils.py")
    )
    utils = importlib.util.module_from_spec(spec)
    sys.modules["distributed.shuffle.tests"] = type(sys)("distributed.shuffle.tests")
    sys.modules["distributed.shuffle.tests.utils"] = utils
    spec.loader.exec_module(utils)
    pytest_plugins = ["distributed.utils_test"]


@pytest.fixture(autouse=True)
def _route(request, monkeypatch):
    import dask

    suite = sys.modules[request.module.__name__]
    if MODE == "distributed":
        with rechunk_p2p.installed():
            # the suite bound dask's ``rechunk`` at import time, before the routing existed
            if hasattr(suite, "rechunk"):
                monkeypatch.setattr(suite, "rechunk", sys.modules["dask.array.rechunk"].rechunk)
            yield
        return
    from distributed import Client, LocalCluster

    with LocalCluster(
        processes=False, n_workers=2, threads_per_worker=1, dashboard_address=":0"
    ) as cluster, Client(cluster):
        if MODE == "dask-install":
            with rechunk_p2p.installed(), dask.config.set({"array.rechunk.method": "p2p"}):
                monkeypatch.setattr(suite, "rechunk", sys.modules["dask.array.rechunk"].rechunk)
                yield
        else:
            def entry(x, chunks="auto", threshold=None, block_size_limit=None,
                      balance=False, method=None):
                return rechunk_p2p.rechunk(
                    x, chunks, threshold=threshold, block_size_limit=block_size_limit,
                    balance=balance,
                )

            monkeypatch.setattr(sys.modules["dask.array.rechunk"], "rechunk", entry)
            monkeypatch.setattr(suite, "rechunk", entry)
            yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _builds[0] = 0


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "skipped" if report.skipped else report.outcome
        with open(RESULTS, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "outcome": outcome,
                                "engine_builds": _builds[0]}) + "\\n")
'''


def _dask_suite_file() -> Path:
    import dask.array.tests.test_rechunk as suite

    return Path(suite.__file__)


def _prepare(suite: str, directory: Path, distributed_git: str | None) -> list[str]:
    """Copy the suite's files into ``directory``; the pytest arguments that select it."""
    (directory / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    if suite.startswith("dask"):
        (directory / "test_rechunk.py").write_text(_dask_suite_file().read_text())
        return ["test_rechunk.py"]
    if not distributed_git:
        raise SystemExit("--distributed PATH (a dask/distributed snapshot) is needed")
    for source, target in _DISTRIBUTED_FILES.items():
        text = subprocess.run(
            ["git", "--git-dir", distributed_git, "show", f"HEAD:{source}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (directory / target).write_text(text)
    return list(_DISTRIBUTED_ARGS)


def run_suite(suite: str, distributed_git: str | None = None, verbose: bool = False) -> dict:
    """Run one suite through the engine; return its per-test records and a summary."""
    with tempfile.TemporaryDirectory(prefix=f"rechunk-p2p-{suite}-") as tmp:
        directory = Path(tmp)
        args = _prepare(suite, directory, distributed_git)
        results = directory / "results.jsonl"
        deselect = [f"--deselect={name}" for name in DESELECTED[suite]]
        env = {
            **os.environ,
            "RECHUNK_P2P_UPSTREAM_MODE": suite,
            "RECHUNK_P2P_UPSTREAM_RESULTS": str(results),
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
            ),
        }
        command = [
            sys.executable, "-m", "pytest", *args, *deselect, "-q", "-p", "no:cacheprovider",
            "--timeout=300", "-o", "addopts=", "-W", "ignore::DeprecationWarning",
            "--rootdir", str(directory),
        ]  # fmt: skip
        proc = subprocess.run(command, cwd=directory, env=env, capture_output=not verbose)
        records = (
            [json.loads(line) for line in results.read_text().splitlines()]
            if (results.exists())
            else []
        )
    return {
        "suite": suite,
        "exit_code": proc.returncode,
        "records": records,
        "summary": summarise(records, DESELECTED[suite]),
        "output": "" if verbose else proc.stdout.decode(errors="replace")[-5000:],
    }


def summarise(records: list[dict], deselected: dict[str, str]) -> dict[str, int]:
    """Counts: passed through the engine, passed without it, failed, skipped, deselected."""
    counts: Counter[str] = Counter()
    for r in records:
        if r["outcome"] == "passed":
            counts["passed (engine ran)" if r["engine_builds"] else "passed (not routed)"] += 1
        else:
            counts[r["outcome"]] += 1
    counts["deselected"] = len(deselected)
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="append", choices=SUITES)
    parser.add_argument("--distributed", help="git directory of a dask/distributed snapshot")
    parser.add_argument("--json", help="write every record here")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    args = parser.parse_args(argv)
    suites = args.suite or [s for s in SUITES if s != "distributed" or args.distributed]
    reports = [run_suite(s, args.distributed, args.verbose) for s in suites]
    failed = False
    for report in reports:
        print(f"{report['suite']}: {report['summary']}")
        for r in report["records"]:
            if r["outcome"] == "failed":
                print(f"  FAILED {r['test']}")
        for name, reason in DESELECTED[report["suite"]].items():
            print(f"  deselected {name}: {reason}")
        if report["exit_code"] not in (0,):
            failed = True
            print(report["output"])
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
