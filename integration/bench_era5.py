"""ERA5 at its own chunk counts: one chunk an hour of a small grid, as a store of ERA5 has
it, rechunked to year-long series, with and without the steps users put before a rechunk
(``astype``, a scale and offset), generated (float64) or read from a zarr store (float32);
rechunk_p2p beside dask's p2p (and tasks), at default settings.

Where it runs: each run in a process of its own (client, and the scheduler of a fresh
2-worker ``LocalCluster`` of 1 thread each, so peaks are the run's own: a scheduler that
materialised an earlier run's graph keeps its heap); the data is made or read on the
workers. The zarr stores are written once (``--store-dir`` keeps them between invocations:
561,264 chunks take minutes to write).

    PYTHONPATH=. .venv/bin/python -m integration.bench_era5 --hours 17520,96432 --repeat 2

Each figure is a median of ``--repeat`` runs (implementations alternated run by run), raw
figures beside: wall (graph building included), seconds to the first task's start, peak
RSS of the client-and-scheduler process and of the larger worker. A run past ``--timeout``
is cancelled (its cluster closed) and reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import rechunk_p2p
from integration.resources import ResourceSampler

#: The steps before the rechunk, by name: what users apply to a store's or a model's data
STEPS: dict[str, Callable[[da.Array], da.Array]] = {
    "none": lambda x: x,
    "astype(float32)": lambda x: x.astype(np.float32),
    "* 0.01 + 273.15": lambda x: x * 0.01 + 273.15,
}
#: The implementations compared, by name
RECHUNKS: dict[str, Callable[[da.Array, tuple], da.Array]] = {
    "rechunk_p2p": rechunk_p2p.rechunk,
    "dask p2p": lambda x, chunks: x.rechunk(chunks, method="p2p"),
    "dask tasks": lambda x, chunks: x.rechunk(chunks, method="tasks"),
}
#: Where the input comes from
ORIGINS = ("made", "zarr")
#: ERA5's grid cut small: the chunk count is what this measures
GRID = (16, 32)
#: Hours in a year: the output's series
YEAR = 8760


def store_path(directory: str, hours: int) -> str:
    """A float32 zarr store of ``hours`` hourly chunks of :data:`GRID` in ``directory``,
    written here the first time (through zarrs' pipeline where installed: several times
    faster for small chunks)."""
    import zarr

    path = os.path.join(directory, f"era5-{hours}h.zarr")
    if os.path.exists(os.path.join(path, "zarr.json")):
        return path
    pipeline = {"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"}
    try:
        import zarrs  # noqa: F401
    except ImportError:
        pipeline = {}
    rng = np.random.default_rng(0)
    with zarr.config.set(pipeline):
        z = zarr.create_array(
            f"{path}.partial", shape=(hours, *GRID), chunks=(1, *GRID), dtype="f4"
        )
        for start in range(0, hours, YEAR):
            stop = min(hours, start + YEAR)
            z[start:stop] = rng.random((stop - start, *GRID), dtype="f4")
    os.rename(f"{path}.partial", path)
    return path


def source(origin: str, hours: int, directory: str) -> da.Array:
    """The input of one origin: generated on the workers, or read from the store."""
    if origin == "made":
        return da.random.random((hours, *GRID), chunks=(1, *GRID))
    return da.from_zarr(store_path(directory, hours))


def run_once(
    client: Client, impl: str, x: da.Array, timeout: float, start: float
) -> dict[str, Any]:
    """One rechunk of ``x`` to year-long series, summed: the figures of the run, or why it
    did not finish. ``start`` is when the input began to be built (wall is from there)."""
    pids = dict(client.run(os.getpid))
    y = RECHUNKS[impl](x, (YEAR, 4, 8)).sum()
    cursor = len(client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.get_task_stream()))
    since = time.time() - (time.perf_counter() - start)
    with ResourceSampler({"client": os.getpid(), **pids}, {}) as sampler:
        future = client.compute(y)
        try:
            future.result(timeout=timeout)
            error = None
        except TimeoutError:
            error = f"did not finish in {timeout:.0f} s"
        except Exception as e:  # a failed run is a figure too
            error = f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - start
    stream = client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.get_task_stream(start_index=cursor)
    )
    starts = [
        s["start"] for r in stream for s in r.get("startstops", ()) if s["action"] == "compute"
    ]
    rss = sampler.peaks().rss_bytes
    return {
        "wall_s": wall,
        "first_task_s": min(starts) - since if starts else None,
        "client_rss": rss.pop("client"),
        "worker_rss": max(rss.values()),
        "error": error,
    }


def measure(
    hours_list: list[int],
    repeat: int,
    implementations: list[str],
    origins: list[str],
    steps: list[str],
    timeout: float,
    directory: str,
) -> dict:
    """``{(hours, origin, step, implementation): [figures of each run]}``."""
    runs: dict = {}
    for hours in hours_list:
        for origin in origins:
            if origin == "zarr":
                store_path(directory, hours)  # (written before any clock starts)
            for step in steps:
                for _ in range(repeat):
                    for impl in implementations:  # alternated run by run
                        figures = _in_own_process(hours, origin, step, impl, timeout, directory)
                        runs.setdefault((hours, origin, step, impl), []).append(figures)
    return runs


def _in_own_process(
    hours: int, origin: str, step: str, impl: str, timeout: float, directory: str
) -> dict[str, Any]:
    """:func:`measure_one` in a new Python process: its figures (or why it gave none)."""
    argv = [sys.executable, "-m", "integration.bench_era5", "--one"]
    argv += [json.dumps([hours, origin, step, impl, timeout, directory])]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 600, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"wall_s": None, "first_task_s": None, "error": f"the run's process: {why}"}
    return json.loads(lines[-1])


def measure_one(
    hours: int, origin: str, step: str, impl: str, timeout: float, directory: str
) -> dict[str, Any]:
    """One run on a fresh cluster: its figures (:func:`run_once`)."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.register(client)
        start = time.perf_counter()
        x = STEPS[step](source(origin, hours, directory))
        return run_once(client, impl, x, timeout, start)


def _median(runs: list[dict], name: str, scale: float = 1.0) -> str:
    values = [r[name] for r in runs if r["error"] is None and r[name] is not None]
    if not values:
        return "-"
    raw = ", ".join(f"{v / scale:.1f}" for v in values)
    return f"{statistics.median(values) / scale:.1f} ({raw})"


def table(runs: dict, implementations: list[str]) -> str:
    """Markdown: a row a chunk count, origin, step and implementation; medians with raw
    figures; rechunk_p2p's wall over the other implementations' and over the same input
    without the step."""
    head = ["hours", "origin", "step", "implementation", "wall s", "first task s"]
    head += ["client+scheduler MiB", "worker MiB", "vs no step", "note"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (hours, origin, step, impl), figures in runs.items():
        failed = [r["error"] for r in figures if r["error"] is not None]
        walls = [r["wall_s"] for r in figures if r["error"] is None]
        alone = [r["wall_s"] for r in runs.get((hours, origin, "none", impl), []) if not r["error"]]
        ratio = "-"
        if walls and alone:
            ratio = f"{statistics.median(walls) / statistics.median(alone):.2f}x"
        cells = [
            f"{hours:,}",
            origin,
            f"`{step}`",
            impl,
            _median(figures, "wall_s"),
            _median(figures, "first_task_s"),
            _median(figures, "client_rss", 2**20),
            _median(figures, "worker_rss", 2**20),
            ratio,
            "; ".join(sorted(set(failed))) or "",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    first = implementations[0]
    lines = ["", f"{first} over the others (median walls; a run that failed counts as none):"]
    for (hours, origin, step, impl), figures in runs.items():
        if impl == first:
            continue
        mine = [r["wall_s"] for r in runs.get((hours, origin, step, first), []) if not r["error"]]
        theirs = [r["wall_s"] for r in figures if not r["error"]]
        if mine and theirs:
            ratio = f"{statistics.median(mine) / statistics.median(theirs):.2f}x"
        else:
            ratio = "no ratio: " + ("theirs did not finish" if mine else "ours did not finish")
        lines.append(f"- {hours:,} {origin} `{step}` vs {impl}: {ratio}")
    return "\n".join(rows + lines)


def _choices(value: str, allowed: Any, what: str) -> list[str]:
    """``value`` split at commas, each one of ``allowed``: else exit with a one-line error."""
    chosen = [v for v in value.split(",") if v]
    unknown = sorted(set(chosen) - set(allowed))
    if unknown or not chosen:
        raise SystemExit(f"unknown {what} {unknown or value!r}; choose from {list(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hours", default="17520,96432", help="comma list of chunk counts (ERA5: 561264)"
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--implementations",
        default="rechunk_p2p,dask p2p",
        help=f"comma list of {list(RECHUNKS)} (the first is compared with the others)",
    )
    parser.add_argument("--origins", default=",".join(ORIGINS), help=f"of {list(ORIGINS)}")
    parser.add_argument("--steps", default="none,* 0.01 + 273.15", help=f"of {list(STEPS)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run")
    parser.add_argument("--store-dir", default=None, help="where the zarr stores are kept")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a run in a process of its own)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(*json.loads(args.one))))
        return
    implementations = _choices(args.implementations, RECHUNKS, "implementations")
    origins = _choices(args.origins, ORIGINS, "origins")
    steps = _choices(args.steps, STEPS, "steps")
    try:
        hours = [int(h) for h in args.hours.split(",")]
    except ValueError:
        raise SystemExit(f"--hours takes whole numbers, comma-separated: {args.hours!r}") from None
    if any(h < 1 for h in hours):
        raise SystemExit(f"--hours must be positive, not {args.hours!r}")
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.store_dir or scratch
        runs = measure(hours, args.repeat, implementations, origins, steps, args.timeout, directory)
    print(table(runs, implementations))


if __name__ == "__main__":
    main()
