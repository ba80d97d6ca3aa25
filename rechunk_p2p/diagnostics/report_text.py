"""Text form of a :class:`LoopLagReport`: a fixed-width table and the stall causes.

Where it runs: pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: loop_stats imports this module to print itself
    from rechunk_p2p.diagnostics.loop_stats import LoopLagReport, LoopLagSummary


def format_report(report: LoopLagReport) -> str:
    """A fixed-width table of a report, one row per process and one for all of them."""
    head = (
        f"Event-loop lag over {report.duration_s:.2f} s "
        f"(probe every {report.interval_ms:g} ms; percentiles are upper bounds within 2 %)"
    )
    cols = (
        f"{'process':<28} {'role':<9} {'samples':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'>50ms':>6} {'>200ms':>6} {'ticks':>6} {'tick max':>9} {'unresp':>6}"
    )
    lines = [head, cols, "-" * len(cols)]
    for addr, s in report.per_process.items():
        sig = report.distributed.get(addr)
        role = sig.server_type.lower() if sig else "?"
        ticks = (
            f"{sig.ticks:>6} {sig.tick_max_ms:>9.1f} {sig.unresponsive_warnings:>6}" if sig else ""
        )
        lines.append(_row(addr, role, s) + " " + ticks)
    lines.append(
        _row("overall", "", report.overall) + f" {'':>6} {'':>9} {report.unresponsive_warnings:>6}"
    )
    if report.missing:
        lines.append(f"missing at the end (left the cluster): {', '.join(report.missing)}")
    lines.extend(_format_causes(report))
    return "\n".join(lines)


def _format_causes(report: LoopLagReport) -> list[str]:
    lines = []
    for addr, c in report.causes.items():
        if c.stall_ms <= 0:
            continue
        lines.append(
            f"{addr}: stalls {c.stall_ms:.0f} ms = loop CPU {c.loop_cpu_ms:.0f} + run-queue wait "
            f"{c.runqueue_ms:.0f} + GIL/blocking {c.other_ms:.0f}; without run-queue wait: "
            f"p99 {c.adjusted_p99_ms:.1f} ms, max {c.adjusted_max_ms:.1f} ms, "
            f"{c.adjusted_stalls_over_200ms} stalls > 200 ms; GC: {c.gc_collections} "
            f"collections ({c.gc_full_collections} full), {c.gc_pause_ms:.0f} ms paused, "
            f"longest {c.gc_max_pause_ms:.0f} ms"
        )
        if c.stacks:
            n, stack = c.stacks[0]
            lines.append(f"  loop stack caught {n}x during stalls (innermost last):")
            lines.extend("    " + line for line in stack.splitlines())
    return lines


def _row(name: str, role: str, s: LoopLagSummary) -> str:
    return (
        f"{name:<28} {role:<9} {s.samples:>8} {s.p50_ms:>8.2f} {s.p99_ms:>8.2f} "
        f"{s.max_ms:>8.1f} {s.stalls_over_50ms:>6} {s.stalls_over_200ms:>6}"
    )
