"""The loop-lag bounds the suite and the benchmark hold rechunk_p2p to.

Where it runs: pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from rechunk_p2p.diagnostics import LoopLagReport


@dataclass(frozen=True)
class LagBounds:
    """**Immutable.** Upper bounds on every probed process's loop lag in one window."""

    p99_ms: float = 20.0
    max_ms: float = 100.0
    stalls_over_200ms: int = 0
    unresponsive_warnings: int = 0


def violations(report: LoopLagReport, bounds: LagBounds) -> list[str]:
    """Human-readable list of every bound a report breaks (empty when all hold)."""
    out = []
    for addr, s in report.per_process.items():
        sig = report.distributed.get(addr)
        who = f"{sig.server_type if sig else 'process'} {addr}"
        if s.p99_ms > bounds.p99_ms:
            out.append(f"{who}: p99 lag {s.p99_ms:.1f} ms > {bounds.p99_ms:g} ms")
        if s.max_ms > bounds.max_ms:
            out.append(f"{who}: max lag {s.max_ms:.1f} ms > {bounds.max_ms:g} ms")
        if s.stalls_over_200ms > bounds.stalls_over_200ms:
            out.append(f"{who}: {s.stalls_over_200ms} stalls over 200 ms")
        if sig and sig.unresponsive_warnings > bounds.unresponsive_warnings:
            out.append(f"{who}: {sig.unresponsive_warnings} 'Event loop was unresponsive' warnings")
    if report.missing:
        out.append(f"processes lost during the window: {report.missing}")
    return out
