"""Larger than memory: rechunk maps to time series into zarr on workers of 2 GiB each.

Where it runs: the benchmark process (client) drives one fresh local cluster per run; a
sampler thread reads worker RSS and local-directory sizes, another asks the scheduler for the
workers' status (paused by distributed's memory monitor?) and who they are (restarted?).

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.bench_large --size 6GiB --repeat 3

Each run: 2 worker processes x 1 thread, ``memory_limit="2GiB"`` (every other setting at its
default, so ``rechunk_p2p`` chooses its storage itself), a 3-D float32 array generated on the
workers one time step (1 MiB) per chunk, rechunked to full time series of 32 x 32 tiles and
written to a zarr store on local disk; then the store is read back and every element checked.
Implementations alternate inside each repeat. A run of ``rechunk_p2p`` in which a worker was
paused or restarted fails the benchmark (exit status 1), as does a wrong result; dask's
methods are reported as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import dask.array as da
from dask.utils import format_bytes, parse_bytes
from distributed import Client, LocalCluster

from integration.bench import _engine_statistics, _worker_info
from integration.resources import ResourceSampler
from integration.workloads import (
    IMPLEMENTATIONS,
    Workload,
    checked,
    rechunk_with,
    source_array,
    time_to_space,
)

MEMORY_LIMIT = "2GiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m integration.bench_large", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size", default="6GiB", help="bytes of the array (default 6GiB)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--impls", default="rechunk_p2p,dask-p2p", help="comma list, in run order")
    p.add_argument("--memory-limit", default=MEMORY_LIMIT, help="per worker (default 2GiB)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="output directory")
    return p.parse_args(argv)


class WorkerHealth:
    """**Thread-safe (guarded by `_lock`).** Polls the scheduler for its workers' status.

    Records every worker address seen and the most workers paused at once; a worker that
    was restarted (by its nanny, past the memory limit) comes back with a new address.
    """

    def __init__(self, client: Client, interval: float = 0.2) -> None:
        self._client = client
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.addresses: set[str] = set()
        self.most_paused = 0
        self.least_workers: int | None = None
        self._thread = threading.Thread(target=self._run_blocking, name="bench-health")

    def __enter__(self) -> WorkerHealth:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_blocking()

    def _run_blocking(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample_blocking()

    def _sample_blocking(self) -> None:
        try:
            status = self._client.run_on_scheduler(_statuses)
        except Exception:
            return  # the scheduler is busy or the client closing: the next sample counts
        with self._lock:
            self.addresses.update(status)
            self.most_paused = max(self.most_paused, sum(s == "paused" for s in status.values()))
            n = len(status)
            self.least_workers = n if self.least_workers is None else min(self.least_workers, n)


def _statuses(dask_scheduler: Any) -> dict[str, str]:
    return {a: ws.status.name for a, ws in dask_scheduler.workers.items()}


def run_one(impl: str, w: Workload, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """One timed run on a fresh cluster, its zarr output checked; never raises."""
    local_dir, store = scratch / f"workers-{impl}", scratch / f"out-{impl}.zarr"
    out: dict[str, Any] = {"impl": impl, "workload": w.name}
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit=args.memory_limit,
            dashboard_address=":0",
            local_directory=str(local_dir),
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        pids, dirs = _worker_info(client)
        stats0 = _engine_statistics(client, impl)
        y = rechunk_with(impl, source_array(w), w.target_chunks)
        with WorkerHealth(client) as health, ResourceSampler(pids, dirs) as sampler:
            start = time.perf_counter()
            try:
                client.compute(y.to_zarr(str(store), compute=False)).result(args.timeout)
                error = None
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            wall = time.perf_counter() - start
        stats1 = _engine_statistics(client, impl)
        ok = error is None and bool(
            client.compute(checked(da.from_zarr(str(store)), w)).result(args.timeout)
        )
    shutil.rmtree(store, ignore_errors=True)
    peaks = sampler.peaks()
    delta = None if stats0 is None or stats1 is None else {k: stats1[k] - stats0[k] for k in stats1}
    return {
        **out,
        "ok": ok,
        "error": error,
        "wall_s": wall,
        "rss_peak_bytes": max(peaks.rss_bytes.values()),
        "disk_peak_bytes": max(peaks.disk_bytes.values()),
        "worker_cpu_s": sum(peaks.cpu_seconds.values()),  # both workers, while timed
        "spilled_bytes": None if delta is None else int(delta["bytes_spilled"]),
        "phases_s": None
        if delta is None
        else {
            k.removeprefix("seconds_"): round(v, 2)
            for k, v in delta.items()
            if k.startswith("seconds_")
        },
        "most_paused": health.most_paused,
        # a restarted worker comes back under a new address; a lost one leaves fewer
        "restarted": max(len(health.addresses) - 2, 2 - (health.least_workers or 0)),
    }


def healthy(run: dict[str, Any]) -> bool:
    """A right result, no worker paused and none restarted or lost."""
    return bool(run["ok"]) and run["most_paused"] == 0 and run["restarted"] == 0


def format_table(runs: list[dict[str, Any]], impls: list[str]) -> str:
    head = (
        f"{'impl':<12} {'ok/n':>5} {'wall s':>7} {'RSS peak':>10} {'disk peak':>10} "
        f"{'spilled':>10} {'paused':>6} {'restarted':>9} {'wrk CPU s':>9}"
    )
    lines = [head, "-" * len(head)]
    for impl in impls:
        mine = [r for r in runs if r["impl"] == impl]
        good = [r for r in mine if r["ok"]]
        if not good:
            lines.append(f"{impl:<12} {f'0/{len(mine)}':>5}")
            continue

        def med(key: str, rows: list[dict[str, Any]] = good) -> float:
            return statistics.median(r[key] or 0 for r in rows)

        lines.append(
            f"{impl:<12} {f'{len(good)}/{len(mine)}':>5} {med('wall_s'):7.1f} "
            f"{format_bytes(med('rss_peak_bytes')):>10} {format_bytes(med('disk_peak_bytes')):>10} "
            f"{format_bytes(med('spilled_bytes')) if med('spilled_bytes') else '-':>10} "
            f"{max(r['most_paused'] for r in mine):>6} {max(r['restarted'] for r in mine):>9} "
            f"{med('worker_cpu_s'):9.1f}"
        )
    lines.append(
        "medians of the runs with a right result; RSS/disk: worst worker; paused: most workers "
        "paused at once by the memory monitor (worst run); restarted: workers restarted or lost "
        "(worst run); wrk CPU s: CPU seconds of both worker processes while timed"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = args.impls.split(",")
    for impl in impls:
        if impl not in IMPLEMENTATIONS:
            raise SystemExit(f"unknown implementation {impl!r}; choose from {IMPLEMENTATIONS}")
    w = time_to_space(int(parse_bytes(args.size)))
    out = args.out or Path("integration/results") / time.strftime("bench-large-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"{w.summary()}; workers 2 x 1 thread, memory_limit {args.memory_limit}", flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rechunk-bench-large-") as scratch:
        for rep in range(args.repeat):
            for impl in impls:
                run = run_one(impl, w, args, Path(scratch)) | {"repeat": rep}
                runs.append(run)
                print(
                    f"[{rep}] {impl:<12} ok {run['ok']} wall {run['wall_s']:.1f} s "
                    f"RSS {format_bytes(run['rss_peak_bytes'])} paused {run['most_paused']} "
                    f"restarted {run['restarted']}"
                    + (f" phases {run['phases_s']}" if run["phases_s"] else "")
                    + (f" ({run['error']})" if run["error"] else ""),
                    flush=True,
                )
                (out / "bench-large.json").write_text(
                    json.dumps({"argv": sys.argv, "workload": w.summary(), "runs": runs})
                )
    print(format_table(runs, impls))
    print("results:", out / "bench-large.json")
    ours = [r for r in runs if r["impl"] == "rechunk_p2p"]
    return 0 if all(healthy(r) for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
