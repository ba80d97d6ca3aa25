"""The benchmark's tables: medians per workload, origin and implementation, the ratios
against dask's methods, and the engine's seconds per phase.

Where it runs: the benchmark process, after the runs (pure formatting).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from dask.utils import format_bytes

from integration.reference import Reference, floor_seconds
from integration.workloads import Workload


def headline(run: dict[str, Any]) -> dict[str, float]:
    """The per-run figures the table and the medians use."""
    lag = run.get("lag") or {}
    overall = lag.get("overall", {})
    workers = [
        s
        for a, s in lag.get("per_process", {}).items()
        if lag["distributed"].get(a, {}).get("server_type") != "Scheduler"
    ]
    causes = list(lag.get("causes", {}).values())
    return {
        "wall_s": run.get("wall_s", float("nan")),
        "p50_ms": overall.get("p50_ms", float("nan")),
        "p99_ms": overall.get("p99_ms", float("nan")),
        "max_ms": overall.get("max_ms", float("nan")),
        "worker_p99_ms": max((s["p99_ms"] for s in workers), default=float("nan")),
        "worker_max_ms": max((s["max_ms"] for s in workers), default=float("nan")),
        "stalls_50": overall.get("stalls_over_50ms", 0),
        "stalls_200": overall.get("stalls_over_200ms", 0),
        "adj_p99_ms": max((c["adjusted_p99_ms"] for c in causes), default=float("nan")),
        "adj_max_ms": max((c["adjusted_max_ms"] for c in causes), default=float("nan")),
        "worker_gc_max_ms": max(
            (
                c.get("gc_max_pause_ms", 0.0)
                for a, c in lag.get("causes", {}).items()
                if lag["distributed"].get(a, {}).get("server_type") != "Scheduler"
            ),
            default=0.0,
        ),
        "unresponsive": sum(
            s["unresponsive_warnings"] for s in lag.get("distributed", {}).values()
        ),
        "rss_peak": max(run.get("rss_peak_bytes", {}).values(), default=0),
        "disk_peak": max(run.get("disk_peak_bytes", {}).values(), default=0),
        "spilled": run.get("spilled_bytes") or 0,
        # CPU seconds of all worker processes together (runs before it was recorded: nan)
        "cpu_s": sum(run["worker_cpu_s"].values()) if run.get("worker_cpu_s") else float("nan"),
        **scale_figures(run, workers),
    }


def scale_figures(run: dict[str, Any], worker_lags: list[dict[str, Any]]) -> dict[str, float]:
    """The figures the many-worker benchmark plots (nan where a run did not record one)."""
    nan = float("nan")
    lag = run.get("lag") or {}
    sched = [
        s
        for a, s in lag.get("per_process", {}).items()
        if lag.get("distributed", {}).get(a, {}).get("server_type") == "Scheduler"
    ]
    cpu, tasks = run.get("worker_cpu_s") or {}, run.get("task_cpu_s") or {}
    idle = run.get("idle_cpu_cores") or {}
    outside = [cpu[a] - tasks[a] for a in cpu if a in tasks]
    messages, sent = run.get("messages_sent"), run.get("bytes_sent")

    def value(v: Any) -> float:
        return nan if v is None else float(v)

    return {
        "scheduler_cpu_s": value(run.get("scheduler_cpu_s")),
        "scheduler_max_ms": max((s["max_ms"] for s in sched), default=nan),
        "scheduler_adj_max_ms": max(
            (
                c["adjusted_max_ms"]
                for a, c in lag.get("causes", {}).items()
                if lag.get("distributed", {}).get(a, {}).get("server_type") == "Scheduler"
            ),
            default=nan,
        ),
        "worker_p50_ms": max((s["p50_ms"] for s in worker_lags), default=nan),
        "worker_adj_max_ms": max(
            (
                c["adjusted_max_ms"]
                for a, c in lag.get("causes", {}).items()
                if lag.get("distributed", {}).get(a, {}).get("server_type") != "Scheduler"
            ),
            default=nan,
        ),
        "cpu_outside_tasks_s": max(outside, default=nan),
        # the workers' CPU less what they took idle (measured just before) for as long
        "cpu_above_idle_s": (
            sum(cpu.values()) - sum(idle.values()) * run["wall_s"] if cpu and idle else nan
        ),
        "messages": value(messages),
        "bytes_per_message": sent / messages if messages and sent is not None else nan,
        "connections": max((run.get("connections_at_end") or {}).values(), default=nan),
        "fds": max((run.get("fds_at_end") or {}).values(), default=nan),
        "to_first_transfer_s": value(run.get("to_first_transfer_s")),
        "barrier_to_last_output_s": value(run.get("barrier_to_last_output_s")),
    }


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median of every headline figure per (workload, implementation), successful runs only."""
    groups: dict[tuple[str, str], list[dict[str, float]]] = {}
    failures: dict[tuple[str, str], int] = {}
    for r in runs:
        key = (r["workload"], r["impl"])
        if r.get("ok"):
            groups.setdefault(key, []).append(headline(r))
        else:
            failures[key] = failures.get(key, 0) + 1
    out = []
    for key in dict.fromkeys([(r["workload"], r["impl"]) for r in runs]):
        rows = groups.get(key, [])
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]} if rows else {}
        origin = next((r.get("origin", "made") for r in runs if r["workload"] == key[0]), "made")
        out.append(
            {
                "workload": key[0],
                "origin": origin,
                "impl": key[1],
                "runs": len(rows),
                "failed": failures.get(key, 0),
                **med,
            }
        )
    return out


def format_table(meds: list[dict[str, Any]]) -> str:
    cols = (
        "workload",
        "origin",
        "impl",
        "ok/n",
        "wall s",
        "p50",
        "p99",
        "max",
        "wrk p99",
        "wrk max",
        ">50",
        ">200",
        "adj p99",
        "adj max",
        "wrk GC",
        "unresp",
        "RSS peak",
        "disk peak",
        "spilled",
        "wrk CPU s",
    )
    widths = (-18, -8, -12, 5, 7, 6, 7, 8, 7, 8, 5, 5, 7, 8, 6, 6, 10, 10, 10, 9)
    fmt = " ".join(f"{{:{'<' if w < 0 else '>'}{abs(w)}}}" for w in widths)
    lines = [fmt.format(*cols), "-" * 160]
    for m in meds:
        if not m["runs"]:
            name, origin = _name(m["workload"]), m.get("origin", "made")
            lines.append(fmt.format(name, origin, m["impl"], f"0/{m['failed']}", *["-"] * 16))
            continue
        lines.append(
            fmt.format(
                _name(m["workload"]),
                m.get("origin", "made"),
                m["impl"],
                f"{m['runs']}/{m['runs'] + m['failed']}",
                f"{m['wall_s']:.1f}",
                f"{m['p50_ms']:.2f}",
                f"{m['p99_ms']:.1f}",
                f"{m['max_ms']:.0f}",
                f"{m['worker_p99_ms']:.1f}",
                f"{m['worker_max_ms']:.0f}",
                f"{m['stalls_50']:g}",
                f"{m['stalls_200']:g}",
                f"{m['adj_p99_ms']:.1f}",
                f"{m['adj_max_ms']:.0f}",
                f"{m['worker_gc_max_ms']:.0f}",
                f"{m['unresponsive']:g}",
                format_bytes(m["rss_peak"]),
                format_bytes(m["disk_peak"]),
                format_bytes(m["spilled"]) if m["spilled"] else "-",
                f"{m['cpu_s']:.1f}",
            )
        )
    lines.append(
        "lag in ms; p50/p99/max over all processes; wrk = worst worker (wrk GC: longest "
        "garbage-collection pause); adj = worst "
        "process after subtracting run-queue wait; RSS/disk = worst worker peak; "
        "wrk CPU s = CPU seconds of all worker processes together"
    )
    return "\n".join(lines)


def _name(label: str) -> str:
    """A workload's name without its origin (shown in a column of its own)."""
    return label.split("/")[0]


def format_ratios(meds: list[dict[str, Any]], data_s: dict[str, float]) -> str:
    """rechunk_p2p's median wall time over each other implementation's, whole and with the
    data-only time taken from both (what the rechunk itself costs)."""
    lines = [
        "rechunk_p2p / other, medians: wall time; and (wall - data only), the rechunk itself; "
        "the workers' CPU seconds",
        f"{'workload':<18} {'origin':<8} {'other':<12} {'data s':>7} {'mine s':>7} {'other s':>7} "
        f"{'wall':>7} {'rechunk':>8} {'CPU':>7}",
    ]
    by = {(m["workload"], m["impl"]): m for m in meds if m["runs"]}
    for (name, impl), m in by.items():
        mine = by.get((name, "rechunk_p2p"))
        if impl == "rechunk_p2p" or mine is None:
            continue
        data = data_s.get(name, float("nan"))
        own, other = mine["wall_s"] - data, m["wall_s"] - data
        rechunk = own / other if other > 0 else float("nan")
        cpu = mine["cpu_s"] / m["cpu_s"] if m["cpu_s"] > 0 else float("nan")
        lines.append(
            f"{_name(name):<18} {m.get('origin', 'made'):<8} {impl:<12} {data:7.1f} "
            f"{mine['wall_s']:7.1f} {m['wall_s']:7.1f} "
            f"{mine['wall_s'] / m['wall_s']:6.2f}x {rechunk:7.2f}x {cpu:6.2f}x"
        )
    return "\n".join(lines)


def format_phases(
    runs: list[dict[str, Any]],
    wls: list[Workload],
    ref: Reference,
    args: argparse.Namespace,
    data_s: dict[str, float],
) -> str:
    """Where rechunk_p2p's time went (its own statistics) beside the machine's floor."""
    phases = ("cut", "queue_wait", "send", "store", "assemble")
    head = (
        f"{'workload':<18} {'origin':<8} {'wall s':>7} {'data s':>7} {'floor s':>8} "
        f"{'floor/wall':>10}  " + " ".join(f"{p:>10}" for p in phases) + f" {'other':>10}"
    )
    lines = [
        "rechunk_p2p per phase (median seconds, summed over workers and threads; "
        f"floor: {ref.summary()})",
        head,
        "-" * len(head),
    ]
    threads = args.workers * args.threads
    for w in wls:
        mine = [r for r in runs if r["workload"] == w.label and r["impl"] == "rechunk_p2p"]
        mine = [r for r in mine if r.get("ok") and r.get("phases_s")]
        if not mine:
            continue
        wall = statistics.median(r["wall_s"] for r in mine)
        med = {p: statistics.median(r["phases_s"][p] for r in mine) for p in phases}
        disk = statistics.median(r.get("spilled_bytes") or 0 for r in mine) > 0
        floor = floor_seconds(ref, w.nbytes, args.workers, disk)
        other = wall * threads - med["cut"] - med["queue_wait"] - med["assemble"]
        lines.append(
            f"{w.name:<18} {w.origin:<8} {wall:7.1f} {data_s.get(w.label, float('nan')):7.1f} "
            f"{floor:8.2f} {floor / wall:10.1%}  "
            + " ".join(f"{med[p]:10.2f}" for p in phases)
            + f" {other:10.1f}"
        )
    lines.append(
        "data s: generating and checking the data alone, no rechunk (a cluster of its own; "
        "derived: the reduction its chunks share); "
        "cut/queue_wait/assemble: task threads; send: sends in flight (summed); store: offload "
        "pool; other: task-thread time outside the engine (input generation, the result "
        f"check, scheduling, idle) of wall x {threads} task threads; floor: 2 memory copies "
        "per byte, the cross-worker share over loopback once (and page-cache write+read when "
        "pieces spilled)"
    )
    return "\n".join(lines)
