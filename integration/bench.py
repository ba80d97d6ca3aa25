"""Benchmark rechunk_p2p against dask's ``method="p2p"`` and ``method="tasks"``.

Where it runs: the benchmark process (client) drives a local 2-process cluster; a sampler
thread reads worker RSS and local-directory sizes; the probes run on each server's loop.

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.bench --size 1.5GiB --repeat 3
    python -m integration.bench --workloads 2d,3d --impls rechunk_p2p,dask-p2p

Implementations alternate inside each repeat (A B C A B C ...), each run on a fresh
cluster (so peak RSS is per run) after an untimed warm-up of the same implementation
(``--reuse-cluster``: one cluster for every run). The data-only time is measured once, on a
cluster of its own. Timed, as in issue 12: generating the input, the rechunk and holding its
outputs in worker memory (``--outputs persisted``); every output is checked after the clock
stops (``--outputs checked``: checked on the workers inside the timed part instead, nothing
kept). Workers log "Event loop was unresponsive" past ``--tick-limit`` (200 ms;
distributed's default is 3 s); the scheduler, in this process, keeps its own setting.
Writes ``bench.json`` and, when matplotlib is installed, ``bench.png`` to ``--out`` and
prints a table of medians across repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import dask
import distributed
from dask.utils import parse_bytes
from distributed import Client, LocalCluster

from integration import run_probes
from integration.bench_tables import (
    format_phases,
    format_ratios,
    format_table,
    headline,
    medians,
)
from integration.lag_bounds import LagBounds, violations
from integration.reference import measure
from integration.resources import ResourceSampler, idle_cpu_blocking
from integration.workloads import (
    DEFAULT_BYTES,
    IMPLEMENTATIONS,
    ORIGINS,
    Workload,
    checked,
    input_array,
    many_small,
    rows_to_columns,
    rows_to_columns_8mib,
    shared_reduction,
    size_from_env,
    thin_rows,
    time_to_space,
    workload_graph,
)
from rechunk_p2p.diagnostics import measure_event_loops

_MAKERS = {
    "2d": rows_to_columns,
    "3d": time_to_space,
    "many": many_small,
    "2d128": rows_to_columns_8mib,
    "thin1": lambda n: thin_rows(n, 1),
    "thin4": lambda n: thin_rows(n, 4),
    "thin16": lambda n: thin_rows(n, 16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m integration.bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size", help="bytes per workload, e.g. 1.5GiB (default: env or built-in)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--workloads",
        default="2d,3d,many,2d128,thin1,thin4,thin16",
        help=f"comma list of {sorted(_MAKERS)}",
    )
    p.add_argument(
        "--origins",
        default="made,made+map,held",
        help=f"comma list of {list(ORIGINS)}: input made inside the rechunk (as it is, or "
        "then scaled and offset), held in worker memory before the clock starts, or derived "
        "from held chunks by a reduction",
    )
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="comma list, in run order")
    p.add_argument("--interval", default="5ms", help="loop-lag probe interval")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before giving up")
    p.add_argument(
        "--reuse-cluster",
        action="store_true",
        help="one cluster for all runs (default: a fresh one per run, so peak RSS is the run's)",
    )
    p.add_argument(
        "--tick-limit",
        default="200ms",
        help='workers log "Event loop was unresponsive" past this (distributed\'s default: 3s)',
    )
    p.add_argument(
        "--outputs",
        choices=("persisted", "checked"),
        default="persisted",
        help="time persisting the outputs, check them afterwards (default, the issue's setup); "
        "or time checking them on the workers",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def workloads_for(args: argparse.Namespace) -> list[Workload]:
    sizes = size_from_env()
    if args.size:
        sizes = dict.fromkeys(DEFAULT_BYTES, int(parse_bytes(args.size)))
    origins = args.origins.split(",")
    unknown = sorted(set(origins) - set(ORIGINS))
    if unknown:
        raise SystemExit(f"unknown origins {unknown}; choose from {list(ORIGINS)}")
    made = [_MAKERS[k](sizes[k]) for k in args.workloads.split(",")]
    return [replace(w, origin=o) for o in origins for w in made]


def _worker_info(client: Client) -> tuple[dict[str, int], dict[str, str]]:
    info = client.run(lambda dask_worker: (os.getpid(), dask_worker.local_directory))
    return {a: v[0] for a, v in info.items()}, {a: v[1] for a, v in info.items()}


def _engine_statistics(client: Client, impl: str) -> dict[str, float] | None:
    """The engine's own totals (spilled bytes, seconds per phase); ``None`` for dask's."""
    if impl != "rechunk_p2p":
        return None
    try:
        import rechunk_p2p

        return rechunk_p2p.cluster_statistics(client)
    except Exception:
        return None


@contextlib.contextmanager
def cluster_client(args: argparse.Namespace, local_dir: str) -> Iterator[Client]:
    """A local cluster of ``args.workers`` processes, every setting at its default but the
    workers' tick limit (``--tick-limit``: the lag past which distributed logs "Event loop
    was unresponsive"; a module constant of ``distributed.core``, so it reaches the worker
    processes through their environment)."""
    name = "DASK_DISTRIBUTED__ADMIN__TICK__LIMIT"
    before = os.environ.get(name)
    os.environ[name] = args.tick_limit
    try:
        cluster = LocalCluster(
            n_workers=args.workers,
            threads_per_worker=args.threads,
            processes=True,
            dashboard_address=":0",
            local_directory=local_dir,
        )
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
    with cluster, Client(cluster) as client:
        yield client


@contextlib.contextmanager
def run_cluster(
    args: argparse.Namespace, local_dir: str, shared: Client, impl: str
) -> Iterator[Client]:
    """The cluster of one run: ``shared`` with ``--reuse-cluster``, else a fresh one on which
    ``impl`` was warmed up."""
    if args.reuse_cluster:
        yield shared
        return
    with cluster_client(args, local_dir) as client:
        warm_up(client, [impl])
        yield client


def run_one(client: Client, impl: str, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """One timed, measured, checked run; never raises for a failed run (records it)."""
    pids, dirs = _worker_info(client)
    stats0 = _engine_statistics(client, impl)
    out: dict[str, Any] = {
        "impl": impl,
        "workload": w.label,
        "origin": w.origin,
        "load_before": os.getloadavg()[0],
    }
    try:
        x = input_array(w, client)  # a held input is held before the clock starts
        y, ok = workload_graph(impl, w, x)
        del x
    except Exception as e:  # e.g. an implementation refusing the workload
        return {**out, "ok": False, "error": f"{type(e).__name__}: {e}"}
    held = None
    idle = idle_cpu_blocking(pids)  # (the input is held by now; nothing runs)
    sched_tid = run_probes.scheduler_thread(client)
    sched_cpu0 = run_probes.thread_cpu_seconds(sched_tid)
    task_cpu0 = run_probes.task_cpu_seconds(client)
    cursor = run_probes.stream_cursor(client)
    with ResourceSampler(pids, dirs) as sampler:
        since = time.time()
        t0 = time.perf_counter()
        with measure_event_loops(
            client, args.interval, timeline_points=1000, capture_stacks="100ms"
        ) as probe:
            try:
                if args.outputs == "persisted":
                    held = client.persist(y)
                    distributed.wait(held, timeout=args.timeout)
                    if any(f.status != "finished" for f in distributed.futures_of(held)):
                        held.compute()  # raises the failure
                    result, error = True, None
                else:
                    result, error = bool(client.compute(ok).result(timeout=args.timeout)), None
            except Exception as e:
                result, error = False, f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - t0
        sampler.stop()  # what the check after the clock uses is not counted
        sched_cpu1 = run_probes.thread_cpu_seconds(sched_tid)
        task_cpu1 = run_probes.task_cpu_seconds(client)
        if held is not None and result:  # after the clock: every output held is right
            result = bool(client.compute(checked(held, w)).result(timeout=args.timeout))
            error = None if result else "wrong values in the outputs"
    times = run_probes.stream_times(client, cursor, since, y.name)
    del held, y, ok
    stats1 = _engine_statistics(client, impl)
    delta = None if stats0 is None or stats1 is None else {k: stats1[k] - stats0[k] for k in stats1}
    report = probe.report
    peaks = sampler.peaks()
    return {
        **out,
        "ok": result,
        "error": error,
        "wall_s": wall,
        "rss_peak_bytes": peaks.rss_bytes,
        "disk_peak_bytes": peaks.disk_bytes,
        "worker_cpu_s": peaks.cpu_seconds,
        "idle_cpu_cores": idle,
        "task_cpu_s": {a: task_cpu1[a] - task_cpu0.get(a, 0.0) for a in task_cpu1},
        "scheduler_cpu_s": (
            None if sched_cpu0 is None or sched_cpu1 is None else sched_cpu1 - sched_cpu0
        ),
        "fds_at_end": peaks.fds,
        "connections_at_end": peaks.connections,
        "messages_sent": None if delta is None else int(delta["messages_sent"]),
        "bytes_sent": None if delta is None else int(delta["bytes_sent"]),
        **times,
        "spilled_bytes": None if delta is None else int(delta["bytes_spilled"]),
        "phases_s": None
        if delta is None
        else {k.removeprefix("seconds_"): v for k, v in delta.items() if k.startswith("seconds_")},
        "bounds_broken": violations(report, LagBounds(max_ms=w.max_ms)) if report else None,
        "lag": report.to_dict() if report else None,
    }


def data_only_seconds(client: Client, w: Workload, outputs: str = "persisted") -> float:
    """Wall time of the same work without the rechunk, the data in its own chunks:
    generating and persisting it (or generating and checking it, ``outputs="checked"``);
    for a derived input, the reduction its chunks share, computed from chunks held before
    the clock starts (every implementation waits for it before deriving any chunk; each
    chunk's own elementwise step is left in, as a rechunk fuses it or not).
    The part of every implementation's wall time that is not the rechunk."""
    if w.origin == "held":  # held before the clock starts: the rechunk is all it times
        return 0.0
    if w.origin == "derived":
        held = input_array(replace(w, origin="held"), client)
        start = time.perf_counter()
        reduced = client.persist(shared_reduction(held))
        distributed.wait(reduced)
        seconds = time.perf_counter() - start
        del reduced, held
        return seconds
    x = input_array(w, client)
    start = time.perf_counter()
    if outputs == "persisted":
        x = client.persist(x)
        distributed.wait(x)
        seconds = time.perf_counter() - start
        ok = client.compute(checked(x, w)).result()
        del x
    else:
        ok = client.compute(checked(x, w)).result()
        seconds = time.perf_counter() - start
    if not ok:
        raise AssertionError(f"{w.label}: the generated data does not check")
    return seconds


def warm_up(client: Client, impls: list[str]) -> None:
    """Untimed small run of each implementation: imports and plugin registration first.
    Then, as on a cluster where no rechunk ran yet, wait until the workers let go of what
    the warm-up froze (their idle unfreeze is a full collection of the heap, 150-250 ms,
    which would otherwise land in the timed run that follows within seconds)."""
    w = rows_to_columns(8 * 2**20)
    for impl in impls:
        _, ok = workload_graph(impl, w)
        if not client.compute(ok).result(timeout=300):
            raise SystemExit(f"warm-up of {impl} produced a wrong result")
    deadline = time.monotonic() + 60
    while any(client.run(_frozen_unused).values()) and time.monotonic() < deadline:
        time.sleep(0.5)


def _frozen_unused() -> bool:
    """On a worker: objects frozen for runs wait for the idle unfreeze."""
    from rechunk_p2p.worker.tuning import PROCESS_TUNING

    return PROCESS_TUNING.frozen_unused


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = args.impls.split(",")
    wls = workloads_for(args)
    out = args.out or Path("integration/results") / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "argv": sys.argv,
        "args": {k: str(v) for k, v in vars(args).items()},
        "workloads": [asdict(w) | {"summary": w.summary()} for w in wls],
        "python": platform.python_version(),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for w in wls:
        print(w.summary(), flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rechunk-bench-") as scratch:
        # before any cluster runs: the machine's own limits, at about the workloads' size
        sample = min(max(max(w.nbytes for w in wls) // 4, 16 * 2**20), 256 * 2**20)
        ref = measure(scratch, nbytes=sample)
    meta["reference"] = asdict(ref)
    print("machine:", ref.summary(), flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="rechunk-bench-") as local_dir,
        contextlib.ExitStack() as stack,
    ):
        shared = stack.enter_context(cluster_client(args, local_dir))
        warm_up(shared, impls)
        data_s = {w.label: data_only_seconds(shared, w, args.outputs) for w in wls}
        meta["data_only_s"] = data_s
        if not args.reuse_cluster:
            stack.close()
        for rep in range(args.repeat):
            for w in wls:
                for impl in impls:
                    with run_cluster(args, local_dir, shared, impl) as client:
                        run = run_one(client, impl, w, args) | {"repeat": rep}
                    runs.append(run)
                    h = headline(run) if run.get("ok") else {}
                    print(
                        f"[{rep}] {w.label:<26} {impl:<12} "
                        + (
                            f"wall {h['wall_s']:7.1f} s  p99 {h['p99_ms']:6.1f} ms  "
                            f"max {h['max_ms']:7.1f} ms"
                            if h
                            else f"FAILED {run.get('error')}"
                        ),
                        flush=True,
                    )
                    _write(out, meta, runs)
    meds = _write(out, meta, runs)
    print(format_table(meds))
    print(format_ratios(meds, data_s))
    if "rechunk_p2p" in impls:
        print(format_phases(runs, wls, ref, args, data_s))
    try:
        from integration.bench_plot import plot

        print("figure:", plot(out / "bench.json", out / "bench.png"))
    except ImportError:
        print("matplotlib not installed: no figure (pip install matplotlib)")
    print("results:", out / "bench.json")
    return 0


def _write(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    meds = medians(runs)
    doc = {
        "meta": meta | {"finished": time.strftime("%Y-%m-%d %H:%M:%S")},
        "medians": meds,
        "runs": runs,
    }
    (out / "bench.json").write_text(json.dumps(doc, default=str))
    return meds


if __name__ == "__main__":
    sys.exit(main())
