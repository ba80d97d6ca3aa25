"""A step before the rechunk: ERA5-shaped generated data, as it is and after the steps users
put before a rechunk (``astype``, a scale and offset), rechunk_p2p beside dask's p2p and
tasks, on one 2-worker cluster (1 thread each), at default settings.

Where it runs: the benchmark's process (client); the data is made on the workers.

    PYTHONPATH=. .venv/bin/python -m integration.bench_steps --hours 17520 --repeat 2

One chunk per hour of a 16 x 32 grid, rechunked to series of ``hours / 2`` steps of 4 x 8
points and summed; medians and the raw walls of each implementation, alternated run by run.
"""

from __future__ import annotations

import argparse
import statistics
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


def measure(hours: int, repeat: int, implementations: list[str]) -> dict:
    """``{(step, implementation): [wall seconds of each run]}``."""
    walls: dict = {}
    target = (hours // 2, 4, 8)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.register(client)
        for step_name, step in STEPS.items():
            for _ in range(repeat):
                for name in implementations:  # alternated run by run
                    x = step(da.random.random((hours, 16, 32), chunks=(1, 16, 32)))
                    y = RECHUNKS[name](x, target).sum()
                    start = time.perf_counter()
                    y.compute()
                    walls.setdefault((step_name, name), []).append(time.perf_counter() - start)
    return walls


def table(walls: dict, implementations: list[str]) -> str:
    """Markdown: one row a step, the median wall of each implementation (raw figures beside)
    and rechunk_p2p's ratio to each other one."""
    head = ["step", *implementations, *(f"vs {n}" for n in implementations[1:])]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step in STEPS:
        med = {n: statistics.median(walls[(step, n)]) for n in implementations}
        cells = [
            f"{med[n]:.1f} s ({', '.join(f'{w:.1f}' for w in walls[(step, n)])})"
            for n in implementations
        ]
        ratios = [f"{med[implementations[0]] / med[n]:.2f}x" for n in implementations[1:]]
        rows.append("| " + " | ".join([f"`{step}`", *cells, *ratios]) + " |")
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
    args = parser.parse_args(argv)
    implementations = args.implementations.split(",")
    unknown = sorted(set(implementations) - set(RECHUNKS))
    if unknown:
        raise SystemExit(f"unknown implementations {unknown}; choose from {list(RECHUNKS)}")
    print(table(measure(args.hours, args.repeat, implementations), implementations))


if __name__ == "__main__":
    main()
