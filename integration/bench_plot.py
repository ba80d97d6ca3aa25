"""The benchmark figure: loop lag over time per implementation; wall time and p99 side by side.

Where it runs: the benchmark process, after the runs (pure plotting of ``bench.json``).
Needs matplotlib (the ``bench`` extra); ``python -m integration.bench_plot bench.json``
redraws a figure from saved results.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_COLOURS = {"rechunk_p2p": "tab:green", "dask-p2p": "tab:blue", "dask-tasks": "tab:orange"}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = sorted(runs, key=lambda r: r["wall_s"])
    return walls[len(walls) // 2]


def plot(results: Path, figure: Path) -> Path:
    """Draw ``figure`` from the ``bench.json`` at ``results``; returns the figure's path."""
    doc = json.loads(Path(results).read_text())
    runs = [r for r in doc["runs"] if r.get("ok") and r.get("lag")]
    workloads = list(dict.fromkeys(r["workload"] for r in doc["runs"]))
    impls = list(dict.fromkeys(r["impl"] for r in doc["runs"]))
    fig, axes = plt.subplots(
        len(workloads),
        3,
        figsize=(16, 3.6 * len(workloads)),
        squeeze=False,
        gridspec_kw={"width_ratios": [3, 1, 1]},
    )
    for row, wl in enumerate(workloads):
        ax_t, ax_w, ax_p = axes[row]
        walls, p99s = [], []
        for impl in impls:
            mine = [r for r in runs if r["workload"] == wl and r["impl"] == impl]
            if not mine:
                walls.append(0.0)
                p99s.append(0.0)
                continue
            r = _median_run(mine)
            tl = r["lag"]["overall"]["timeline"]
            ax_t.plot(
                [p[0] for p in tl],
                [max(p[1], 0.01) for p in tl],
                lw=0.8,
                color=_COLOURS.get(impl),
                label=f"{impl} ({r['wall_s']:.1f} s)",
            )
            walls.append(statistics.median(x["wall_s"] for x in mine))
            p99s.append(statistics.median(x["lag"]["overall"]["p99_ms"] for x in mine))
        ax_t.set_yscale("log")
        ax_t.axhline(100, color="grey", ls="--", lw=0.6)
        ax_t.axhline(20, color="grey", ls=":", lw=0.6)
        ax_t.set_title(f"{wl}: loop lag over time (worst process per bucket, median run)")
        ax_t.set_xlabel("seconds")
        ax_t.set_ylabel("lag (ms)")
        ax_t.legend(fontsize=8, loc="upper right")
        colours = [_COLOURS.get(i, "grey") for i in impls]
        ax_w.bar(impls, walls, color=colours)
        ax_w.set_title("wall time (s, median)")
        ax_p.bar(impls, p99s, color=colours)
        ax_p.axhline(20, color="grey", ls=":", lw=0.6)
        ax_p.set_title("loop lag p99 (ms, median)")
        for ax in (ax_w, ax_p):
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    return Path(figure)


if __name__ == "__main__":
    src = Path(sys.argv[1])
    print(plot(src, src.with_suffix(".png")))
