"""A cluster that grows during a rechunk: how evenly the outputs end up, and at what cost.

Where it runs: the benchmark process (client, and the scheduler of each local cluster, which
runs in this process) drives one fresh cluster per run.

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.bench_elastic --repeat 2

Each run: a ``LocalCluster`` of worker processes x 1 thread with nannies and a 4 GiB memory
limit, every setting at its default; issue 58's workload, daily maps ``(3650, 180, 360)``
float32 (1.8 GiB), one chunk a day, rechunked to ``(3650, 45, 45)`` and persisted, the input
made inside the rechunk (``made``) or persisted on the first worker before the clock starts
(``held``); the values are the benchmark's index hash, or with ``--maker random`` dask's
random numbers cast to float32 (slower to make, so the transfers last as in the issue).
Two scenarios:

- ``grow``: 1 worker when the rechunk starts, scaled to 4 one second later;
- ``four``: 4 workers from the start (the baseline ``grow`` is held to).

Implementations alternate within a repeat. Reported per row (medians; raw values in the
JSON): wall from ``persist`` to the outputs in memory, the largest worker's share of the
output bytes, the first worker's peak RSS (the one that is there from the start), and for
``rechunk_p2p`` the workers its runs took in. Every output is checked after the clock stops;
a wrong result fails the benchmark (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import dask.array as da
from dask.utils import format_bytes
from distributed import Client, LocalCluster, futures_of, wait

from integration.resources import ResourceSampler
from integration.workloads import Workload, checked, input_array, rechunk_with

SCENARIOS = ("grow", "four")
ORIGINS = ("made", "held")
IMPLEMENTATIONS = ("rechunk_p2p", "dask-p2p")
MAKERS = ("hash", "random")
#: Workers at the end of every run, and the seconds after which ``grow`` scales to them
WORKERS = 4
GROW_AFTER = 1.0


def workload(origin: str, days: int = 3650) -> Workload:
    """Issue 58's rechunk of daily maps into 45 x 45 time series (``days`` of them)."""
    return Workload(
        "daily-maps",
        f"({days}, 180, 360) f4, a chunk a day -> ({days}, 45, 45)",
        (days, 180, 360),
        "float32",
        (1, 180, 360),
        (days, 45, 45),
        origin=origin,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--origins", default=",".join(ORIGINS))
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    p.add_argument("--days", type=int, default=3650, help="maps (1.8 GiB for 3650)")
    p.add_argument(
        "--maker",
        choices=MAKERS,
        default="hash",
        help="the maps' values: the benchmark's index hash (checked element by element), or "
        "dask's random numbers cast to float32, as the issue made them (slower to make; "
        "checked by their sum)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run")
    p.add_argument("--out", default="integration/results")
    return p.parse_args(argv)


def _plugin_counts(dask_scheduler: Any) -> dict:  # runs on the scheduler
    plugin = dask_scheduler.plugins.get("rechunk-p2p")
    return dict(vars(plugin.recovery.counts)) if plugin is not None else {}


def _random_maps(w: Workload, client: Client) -> da.Array:
    """``w``'s maps as dask's random numbers cast to float32 (held: persisted first)."""
    x = da.random.RandomState(0).random(w.shape, chunks=w.source_chunks).astype("float32")
    if w.origin == "held":
        x = client.persist(x)
        wait(x)
    return x


def _same_sum(y: da.Array, x: da.Array) -> bool:
    """Whether ``y`` (the rechunked ``x``) holds what ``x`` does, by their sums."""
    total, expected = da.compute(y.sum(dtype="float64"), x.sum(dtype="float64"))
    return bool(abs(total - expected) <= 1e-9 * abs(expected))


def run_once(
    impl: str, scenario: str, origin: str, timeout: float, days: int = 3650, maker: str = "hash"
) -> dict[str, Any]:
    """One rechunk on a fresh cluster; its figures."""
    w = workload(origin, days)
    start_workers = 1 if scenario == "grow" else WORKERS
    with (
        LocalCluster(
            n_workers=start_workers,
            threads_per_worker=1,
            memory_limit="4GiB",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        if impl == "rechunk_p2p":
            import rechunk_p2p

            rechunk_p2p.register(client)
        client.wait_for_workers(start_workers, timeout=120)
        first = next(iter(client.scheduler_info()["workers"]))
        # (held: persisted on the first worker, not timed)
        x = input_array(w, client) if maker == "hash" else _random_maps(w, client)
        y = rechunk_with(impl, x, w.target_chunks)
        pid = client.run(os.getpid, workers=[first])[first]
        with ResourceSampler({first: pid}, {}) as sampler:
            t0 = time.perf_counter()
            held = client.persist(y)
            if scenario == "grow":
                time.sleep(GROW_AFTER)
                cluster.scale(WORKERS)
            wait(held, timeout=timeout)
            wall = time.perf_counter() - t0
        futures = futures_of(held)
        who = client.who_has(futures)
        nbytes = client.nbytes(list(who), summary=False)
        per_worker: dict[str, int] = {}
        for key, holders in who.items():
            for worker in holders:
                per_worker[worker] = per_worker.get(worker, 0) + nbytes[key]
        correct = bool(checked(held, w).compute()) if maker == "hash" else _same_sum(held, x)
        counts = client.run_on_scheduler(_plugin_counts)
    total = sum(nbytes.values())
    return {
        "impl": impl,
        "maker": maker,
        "scenario": scenario,
        "origin": origin,
        "wall_s": wall,
        "largest_share": max(per_worker.values()) / total if total else 0.0,
        "holders": len(per_worker),
        "first_worker_rss": sampler.peaks().rss_bytes.get(first, 0),
        "joined": counts.get("joined", 0),
        "inputs_resent": counts.get("inputs_resent", 0),
        "correct": correct,
    }


def _median(rows: list[dict], name: str) -> float:
    return statistics.median(r[name] for r in rows)


def table(results: list[dict]) -> str:
    """The medians as a markdown table, a row per scenario, origin and implementation."""
    lines = [
        "| scenario | origin | engine | wall s (raw) | largest share | holders | "
        "first worker peak RSS | joined |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["scenario"], r["origin"], r["impl"]) for r in results})
    for scenario, origin, impl in keys:
        rows = [
            r
            for r in results
            if (r["scenario"], r["origin"], r["impl"]) == (scenario, origin, impl)
        ]
        raw = " / ".join(f"{r['wall_s']:.1f}" for r in rows)
        lines.append(
            f"| {scenario} | {origin} | {impl} | {_median(rows, 'wall_s'):.1f} ({raw}) | "
            f"{_median(rows, 'largest_share'):.2f} | {_median(rows, 'holders'):.0f} | "
            f"{format_bytes(_median(rows, 'first_worker_rss'))} | "
            f"{_median(rows, 'joined'):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for _ in range(args.repeat):
        for scenario in args.scenarios.split(","):
            for origin in args.origins.split(","):
                for impl in args.impls.split(","):
                    row = run_once(impl, scenario, origin, args.timeout, args.days, args.maker)
                    print(json.dumps(row), flush=True)
                    results.append(row)
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"elastic-{os.getpid()}.json"
    path.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
