"""How the engine and dask's P2P scale with the worker count: the many-worker benchmark.

Where it runs: the benchmark process; each point is one ``integration.bench`` run (fresh
clusters of that many worker processes of one thread, held inputs, the implementations side
by side), so every figure comes from the benchmark's own code path.

Two sweeps per workload: **weak** scaling (``--per-worker`` bytes a worker, so each worker
holds the same bytes at every count) and **strong** scaling (``--size`` in all). Per point
and implementation: wall time, the workers' CPU (summed, and the largest per-worker CPU
outside task threads), the scheduler loop thread's CPU and its loop's worst lag, the workers'
loop lag (and without the wait for a core, which oversubscribed workers spend mostly
in the run queue), messages sent and bytes per message (the engine's own counters; dask's P2P does
not count them), TCP connections and file descriptors of a worker at the end, peak worker RSS,
seconds to the first transfer and from the last barrier to the last output. Beside the
medians, each run's own wall time and workers' CPU (raw and above idle); an implementation
whose runs all failed at a count is reported with its error, not left out.

The loops are probed every ``--interval``, 20 ms by default (distributed's own tick
interval), not the single benchmark's 5 ms: each probe sample wakes its process, about
57 microseconds of CPU on this project's machine, and 33 processes probed every 5 ms took
0.4-0.6 of its 2 cores (idle workers without a probe: 1.0), a load both engines' runs
carried. A stall of ``d`` reads as ``d - interval`` to ``d``.

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.many_workers --workers 2,4,8,16,32

On a machine with fewer cores than workers every implementation is oversubscribed alike;
the figure's title says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dask.utils import format_bytes, parse_bytes

from integration import bench
from integration.bench_tables import headline

#: How often the loops are probed (see the module's docstring)
PROBE_INTERVAL = "20ms"

#: The figures of each point, in the table's and the figure's order: (key, label, scale)
FIGURES = (
    ("wall_s", "wall s", 1.0),
    ("cpu_s", "workers' CPU s", 1.0),
    ("cpu_above_idle_s", "workers' CPU above idle s", 1.0),
    ("cpu_outside_tasks_s", "max CPU outside tasks s", 1.0),
    ("scheduler_cpu_s", "scheduler CPU s", 1.0),
    ("scheduler_max_ms", "scheduler loop max ms", 1.0),
    ("scheduler_adj_max_ms", "scheduler max w/o run queue ms", 1.0),
    ("worker_max_ms", "worker loop max ms", 1.0),
    ("worker_adj_max_ms", "worker max w/o run queue ms", 1.0),
    ("messages", "messages", 1.0),
    ("bytes_per_message", "KiB per message", 1 / 1024),
    ("connections", "TCP connections of a worker", 1.0),
    ("fds", "fds of a worker", 1.0),
    ("rss_peak", "max worker RSS MiB", 1 / 2**20),
    ("to_first_transfer_s", "to first transfer s", 1.0),
    ("barrier_to_last_output_s", "barrier to last output s", 1.0),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m integration.many_workers", description=__doc__)
    p.add_argument("--workers", default="2,4,8,16,32", help="comma list of worker counts")
    p.add_argument("--workloads", default="2d128,3d", help="comma list of bench workloads")
    p.add_argument("--per-worker", default="32MiB", help="bytes a worker (weak scaling)")
    p.add_argument("--size", default="512MiB", help="bytes in all (strong scaling)")
    p.add_argument("--sweeps", default="weak,strong", help="comma list of weak, strong")
    p.add_argument("--impls", default="rechunk_p2p,dask-p2p")
    p.add_argument("--origin", default="held", help="the inputs' origin (see bench)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--interval", default=PROBE_INTERVAL, help="loop-lag probe interval")
    p.add_argument("--out", type=Path, default=Path("integration/results/many-workers"))
    return p.parse_args(argv)


#: The figures kept of every single run beside the medians (raw figures)
RUN_FIGURES = ("wall_s", "cpu_s", "cpu_above_idle_s")


def point(args: argparse.Namespace, workload: str, size: int, workers: int) -> list[dict]:
    """Medians of one benchmark run of ``workers`` workers: one dict per implementation,
    also where every run of it failed (``runs`` 0, the errors in ``errors``), with each
    run's own :data:`RUN_FIGURES` (or error) in ``per_run``."""
    with tempfile.TemporaryDirectory(prefix="rechunk-many-") as out:
        argv = [
            "--size", str(size), "--workloads", workload, "--impls", args.impls,
            "--origins", args.origin, "--repeat", str(args.repeat),
            "--workers", str(workers), "--threads", "1", "--interval", args.interval,
            "--out", out,
        ]  # fmt: skip
        bench.main(argv)
        doc = json.loads((Path(out) / "bench.json").read_text())
    probed = {r["lag"]["interval_ms"] for r in doc["runs"] if r.get("lag")}
    extra = {"size": size, "workers": workers, "probe_interval_ms": max(probed, default=None)}
    points = []
    for m in doc["medians"]:
        runs = [r for r in doc["runs"] if r["impl"] == m["impl"]]
        figures = [headline(r) if r.get("ok") else None for r in runs]
        per_run = [
            {"error": r.get("error")} if h is None else {k: h[k] for k in RUN_FIGURES}
            for r, h in zip(runs, figures)
        ]
        errors = sorted({r.get("error") or "wrong result" for r in runs if not r.get("ok")})
        points.append(m | extra | {"per_run": per_run, "errors": errors})
    return points


def format_points(points: list[dict[str, Any]]) -> str:
    """One row per (sweep, workload, workers, implementation) with every figure."""
    head = ["sweep", "workload", "workers", "impl", *(label for _, label, _ in FIGURES)]
    rows = [head]
    for p in points:
        values = [p.get(key, float("nan")) * scale for key, _, scale in FIGURES]
        rows.append(
            [p["sweep"], p["workload"], str(p["workers"]), p["impl"], *(f"{v:.3g}" for v in values)]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def format_runs(points: list[dict[str, Any]]) -> str:
    """Every run's own wall time and workers' CPU (raw, above idle), or its error."""
    lines = ["each run: wall s, workers' CPU s, above idle s"]
    for p in points:
        runs = [
            "failed" if "error" in r else " / ".join(f"{r[k]:.2f}" for k in RUN_FIGURES)
            for r in p.get("per_run", [])
        ]
        lines.append(
            f"  {p['sweep']:6s} {p['workload']:22s} {p['workers']:3d} {p['impl']:12s} "
            + ",  ".join(runs)
        )
    return "\n".join(lines)


def format_ratios(points: list[dict[str, Any]], impls: list[str]) -> str:
    """Wall time and workers' CPU of the first implementation over each other one's."""
    mine, others = impls[0], impls[1:]
    by = {(p["sweep"], p["workload"], p["workers"], p["impl"]): p for p in points}
    lines = [f"{mine} / other: wall, workers' CPU"]
    for (sweep, workload, workers, impl), p in by.items():
        if impl != mine:
            continue
        for other in others:
            q = by.get((sweep, workload, workers, other))
            if q is None:
                continue
            if not p["runs"] or not q["runs"]:
                failed = q if p["runs"] else p
                lines.append(
                    f"  {sweep:6s} {workload:22s} {workers:3d} workers vs {other}: "
                    f"{failed['impl']} failed ({'; '.join(failed['errors'])[:200]})"
                )
                continue
            wall, cpu = p["wall_s"] / q["wall_s"], p["cpu_s"] / q["cpu_s"]
            lines.append(
                f"  {sweep:6s} {workload:22s} {workers:3d} workers vs {other}: "
                f"wall {wall:.2f}x  CPU {cpu:.2f}x"
            )
    return "\n".join(lines)


def format_growth(points: list[dict[str, Any]]) -> str:
    """The workers' CPU at each count over that at the smallest, per sweep, workload and
    implementation: raw, and above what the workers take idle (``nan`` where not recorded).
    In a strong sweep the bytes are the same at every count."""
    lines = ["workers' CPU over that at the fewest workers: raw, above idle"]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for p in points:
        if p["runs"]:
            groups.setdefault((p["sweep"], p["workload"], p["impl"]), []).append(p)
    for (sweep, workload, impl), group in groups.items():
        group.sort(key=lambda p: p["workers"])
        first = group[0]
        for p in group[1:]:
            raw = p["cpu_s"] / first["cpu_s"]
            above = p.get("cpu_above_idle_s", float("nan")) / first.get(
                "cpu_above_idle_s", float("nan")
            )
            lines.append(
                f"  {sweep:6s} {workload:22s} {impl:12s} {p['workers']:3d} vs "
                f"{first['workers']:3d} workers: {raw:.2f}x, {above:.2f}x"
            )
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], figure: Path, title: str) -> Path:
    """Each figure against the worker count, one line per sweep, workload and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = -(-len(FIGURES) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    lines = dict.fromkeys((p["sweep"], p["workload"], p["impl"]) for p in points)
    for (key, label, scale), ax in zip(FIGURES, axes.flat):
        for sweep, workload, impl in lines:
            mine = sorted(
                (
                    p
                    for p in points
                    if (p["sweep"], p["workload"], p["impl"]) == (sweep, workload, impl)
                ),
                key=lambda p: p["workers"],
            )
            style = "o-" if impl == "rechunk_p2p" else "s--"
            ax.plot(
                [p["workers"] for p in mine],
                [p.get(key, float("nan")) * scale for p in mine],
                style,
                label=f"{impl} {workload} {sweep}",
            )
        ax.set_xscale("log", base=2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("workers")
    for ax in list(axes.flat)[len(FIGURES) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=90)
    return figure


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    per_worker, size = parse_bytes(args.per_worker), parse_bytes(args.size)
    points = []
    for workload in args.workloads.split(","):
        for sweep in args.sweeps.split(","):
            for n in counts:
                nbytes = per_worker * n if sweep == "weak" else size
                print(f"== {sweep} {workload}: {n} workers, {format_bytes(nbytes)}", flush=True)
                points += [p | {"sweep": sweep} for p in point(args, workload, nbytes, n)]
    args.out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    title = (
        f"{args.origin} inputs, 1 thread a worker, {cores} cores (oversubscribed past {cores} "
        f"workers); weak: {args.per_worker} a worker, strong: {args.size}; medians of "
        f"{args.repeat}; loops probed every {args.interval}"
    )
    meta = {"argv": sys.argv, "title": title}
    (args.out / "many_workers.json").write_text(json.dumps({"meta": meta, "points": points}))
    print(format_points(points))
    print(format_runs(points))
    print(format_ratios(points, args.impls.split(",")))
    print(format_growth(points))
    print("figure:", plot(points, args.out / "many_workers.png", title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
