"""A step before the rechunk: ERA5-shaped data, generated (float64) or read from a zarr
store (int16), as it is and after the steps users put before a rechunk (``astype``, a scale
and offset), rechunk_p2p beside dask's p2p and tasks, on one 2-worker cluster (1 thread
each), at default settings.

Where it runs: the benchmark's process (client, which also writes the zarr store); the data
is made or read on the workers.

    PYTHONPATH=. .venv/bin/python -m integration.bench_steps --hours 17520 --repeat 2

One chunk per hour of a 16 x 32 grid, rechunked to series of ``hours / 2`` steps of 4 x 8
points and summed; medians and the raw walls of each implementation, alternated run by run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import rechunk_p2p

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


def _inputs(hours: int, origins: list[str], directory: str) -> dict[str, Callable[[], da.Array]]:
    """A function that makes each origin's input array: generated on the workers, or read
    from an int16 zarr store written here first (one chunk an hour)."""
    shape, chunks = (hours, 16, 32), (1, 16, 32)
    made = {"made": lambda: da.random.random(shape, chunks=chunks)}
    if "zarr" in origins:
        import zarr

        path = os.path.join(directory, "hourly.zarr")
        store = zarr.create_array(path, shape=shape, chunks=chunks, dtype="i2")
        store[:] = np.random.default_rng(0).integers(-2000, 2000, shape, dtype="i2")
        made["zarr"] = lambda: da.from_zarr(path)
    return {origin: made[origin] for origin in origins}


def measure(hours: int, repeat: int, implementations: list[str], origins: list[str]) -> dict:
    """``{(origin, step, implementation): [wall seconds of each run]}``."""
    walls: dict = {}
    target = (hours // 2, 4, 8)
    with (
        tempfile.TemporaryDirectory() as directory,
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.register(client)
        inputs = _inputs(hours, origins, directory)
        for origin, source in inputs.items():
            for step_name, step in STEPS.items():
                for _ in range(repeat):
                    for name in implementations:  # alternated run by run
                        y = RECHUNKS[name](step(source()), target).sum()
                        start = time.perf_counter()
                        y.compute()
                        took = time.perf_counter() - start
                        walls.setdefault((origin, step_name, name), []).append(took)
    return walls


def table(walls: dict, implementations: list[str]) -> str:
    """Markdown: one row an origin and step, the median wall of each implementation (raw
    figures beside), rechunk_p2p's ratio to each other one and to the same origin without
    the step."""
    head = [
        "origin",
        "step",
        *implementations,
        *(f"vs {n}" for n in implementations[1:]),
        "vs no step",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = implementations[0]
    for origin, step, _ in [k for k in walls if k[2] == first]:
        med = {n: statistics.median(walls[(origin, step, n)]) for n in implementations}
        cells = [
            f"{med[n]:.1f} s ({', '.join(f'{w:.1f}' for w in walls[(origin, step, n)])})"
            for n in implementations
        ]
        ratios = [f"{med[first] / med[n]:.2f}x" for n in implementations[1:]]
        alone = statistics.median(walls[(origin, "none", first)])
        cells = [origin, f"`{step}`", *cells, *ratios, f"{med[first] / alone:.2f}x"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=int, default=17520, help="chunks (default 17520)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--implementations",
        default="rechunk_p2p,dask p2p",
        help=f"comma list of {list(RECHUNKS)} (the first is compared with the others)",
    )
    parser.add_argument(
        "--origins", default=",".join(ORIGINS), help=f"comma list of {list(ORIGINS)}"
    )
    args = parser.parse_args(argv)
    implementations = args.implementations.split(",")
    origins = args.origins.split(",")
    unknown = sorted(set(implementations) - set(RECHUNKS)) + sorted(set(origins) - set(ORIGINS))
    if unknown:
        raise SystemExit(
            f"unknown {unknown}; choose from {list(RECHUNKS)} and origins {list(ORIGINS)}"
        )
    walls = measure(args.hours, args.repeat, implementations, origins)
    print(table(walls, implementations))


if __name__ == "__main__":
    main()
