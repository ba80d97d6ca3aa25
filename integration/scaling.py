"""Scaling of wall time and peak worker memory with bytes and with workers.

Where it runs: the benchmark process; each point is one ``integration.bench`` run (its own
cluster), so every figure comes from the same code path as the benchmark table.

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.scaling --workload 3d \\
        --sizes 256MiB,512MiB,1GiB,2GiB --workers 2,4,8 --out docs/img/scaling.png

Sizes run on 2 workers; worker counts run at the largest size below 2 GiB (1 GiB by default).
Workers have one thread each; on a machine with fewer cores than workers the threads are
oversubscribed, which the figure's title says.
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


def _point(workload: str, size: int, workers: int, impls: str, repeat: int) -> list[dict]:
    """Medians of one benchmark run: one dict per implementation."""
    with tempfile.TemporaryDirectory(prefix="rechunk-scaling-") as out:
        argv = [
            "--size", str(size), "--workloads", workload, "--impls", impls,
            "--repeat", str(repeat), "--workers", str(workers), "--out", out,
        ]  # fmt: skip
        bench.main(argv)
        doc = json.loads((Path(out) / "bench.json").read_text())
    return [m | {"size": size, "workers": workers} for m in doc["medians"] if m.get("runs")]


def plot(points: list[dict[str, Any]], figure: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    sizes = [p for p in points if p["sweep"] == "bytes"]
    counts = [p for p in points if p["sweep"] == "workers"]
    for impl in dict.fromkeys(p["impl"] for p in points):
        by_size = sorted((p for p in sizes if p["impl"] == impl), key=lambda p: p["size"])
        by_workers = sorted((p for p in counts if p["impl"] == impl), key=lambda p: p["workers"])
        gib = [p["size"] / 2**30 for p in by_size]
        axes[0][0].plot(gib, [p["wall_s"] for p in by_size], "o-", label=impl)
        axes[1][0].plot(gib, [p["rss_peak"] / 2**20 for p in by_size], "o-", label=impl)
        n = [p["workers"] for p in by_workers]
        axes[0][1].plot(n, [p["wall_s"] for p in by_workers], "o-", label=impl)
        axes[1][1].plot(n, [p["rss_peak"] / 2**20 for p in by_workers], "o-", label=impl)
    axes[0][0].set(xlabel="GiB (2 workers)", ylabel="wall s", title="wall time vs bytes")
    axes[1][0].set(xlabel="GiB (2 workers)", ylabel="MiB", title="peak worker RSS vs bytes")
    axes[0][1].set(xlabel="workers", ylabel="wall s", title="wall time vs workers")
    axes[1][1].set(xlabel="workers", ylabel="MiB", title="peak worker RSS vs workers")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(figure, dpi=90)
    return figure


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.scaling", description=__doc__)
    p.add_argument("--workload", default="3d")
    p.add_argument("--sizes", default="256MiB,512MiB,1GiB,2GiB")
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--at", default="1GiB", help="size of the worker sweep")
    p.add_argument("--impls", default="rechunk_p2p,dask-p2p")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("scaling.png"))
    args = p.parse_args(argv)
    points = []
    for size in (int(parse_bytes(s)) for s in args.sizes.split(",")):
        for m in _point(args.workload, size, 2, args.impls, args.repeat):
            points.append(m | {"sweep": "bytes"})
    at = int(parse_bytes(args.at))
    for workers in (int(w) for w in args.workers.split(",")):
        for m in _point(args.workload, at, workers, args.impls, args.repeat):
            points.append(m | {"sweep": "workers"})
    (args.out.with_suffix(".json")).write_text(json.dumps(points, default=str))
    title = (
        f"{args.workload}, 1 thread per worker, {os.cpu_count()} cores (workers beyond that "
        f"are oversubscribed); worker sweep at {format_bytes(at)}; medians of {args.repeat}"
    )
    print("figure:", plot(points, args.out, title))
    for pt in points:
        print(
            f"{pt['sweep']:<8} {pt['impl']:<12} {format_bytes(pt['size']):>10} "
            f"{pt['workers']:>2} workers  wall {pt['wall_s']:6.1f} s  "
            f"RSS {format_bytes(pt['rss_peak'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
