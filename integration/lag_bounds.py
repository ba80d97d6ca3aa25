"""The loop-lag bounds the suite and the benchmark hold rechunk_p2p to.

Where it runs: pure.

By default the lag bounds are checked on the workers' *contention-adjusted* lag (each
sample's lag minus the time the loop thread waited for a CPU, see
:mod:`rechunk_p2p.diagnostics.stall_causes`): on a shared two-core machine the OS alone
delays a loop by hundreds of milliseconds, whatever the code does. The scheduler is held
to "no unresponsive warning" only: with tens of thousands of tasks, distributed's own graph
submission and the scheduler's garbage collections stall its loop for every
implementation alike. ``strict=True`` (``RECHUNK_P2P_STRICT_LAG=1``) checks the raw lag
as well, on every process including the scheduler, for quiet machines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rechunk_p2p.diagnostics import LoopLagReport


@dataclass(frozen=True)
class LagBounds:
    """**Immutable.** Upper bounds on every probed process's loop lag in one window."""

    p99_ms: float = 20.0
    max_ms: float = 100.0
    stalls_over_200ms: int = 0
    unresponsive_warnings: int = 0
    #: how many times longer than on a quiet machine the lags may be (see :func:`widened`)
    widening: float = 1.0


def widened(bounds: LagBounds, by: float) -> LagBounds:
    """``bounds`` with their lags ``by`` times longer (a machine busy with other work); past
    1, the count of stalls over 200 ms is not held (the widened maximum is), and a process
    with "unresponsive" warnings passes if its loop, without the time it waited for a CPU,
    kept within distributed's tick limit ``by`` times over (the warning's threshold is
    fixed: the other work's share of a stall counts in it)."""
    if by <= 1.0:
        return bounds
    return LagBounds(
        bounds.p99_ms * by, bounds.max_ms * by, 10**9, bounds.unresponsive_warnings, by
    )


def strict_from_env() -> bool:
    """``RECHUNK_P2P_STRICT_LAG=1``: also hold the raw (unadjusted) lag to the bounds."""
    return os.environ.get("RECHUNK_P2P_STRICT_LAG", "") not in ("", "0", "false", "no")


def violations(report: LoopLagReport, bounds: LagBounds, strict: bool = False) -> list[str]:
    """Human-readable list of every bound a report breaks (empty when all hold)."""
    out = []
    for addr, s in report.per_process.items():
        sig = report.distributed.get(addr)
        who = f"{sig.server_type if sig else 'process'} {addr}"
        if sig and sig.unresponsive_warnings > bounds.unresponsive_warnings:
            c = report.causes.get(addr)
            limit_ms = sig.tick_limit_s * 1000 * bounds.widening
            if bounds.widening <= 1.0 or c is None or not c.adjusted_max_ms <= limit_ms:
                out.append(
                    f"{who}: {sig.unresponsive_warnings} 'Event loop was unresponsive' warnings"
                )
        if not strict and sig is not None and sig.server_type == "Scheduler":
            continue
        figures = [("raw", s.p99_ms, s.max_ms, s.stalls_over_200ms)] if strict else []
        c = report.causes.get(addr)
        if c is not None:
            figures.append(
                ("adjusted", c.adjusted_p99_ms, c.adjusted_max_ms, c.adjusted_stalls_over_200ms)
            )
        else:
            figures = [("raw", s.p99_ms, s.max_ms, s.stalls_over_200ms)]
        for kind, p99, worst, stalls in figures:
            if p99 > bounds.p99_ms:
                out.append(f"{who}: {kind} p99 lag {p99:.1f} ms > {bounds.p99_ms:g} ms")
            if worst > bounds.max_ms:
                out.append(f"{who}: {kind} max lag {worst:.1f} ms > {bounds.max_ms:g} ms")
            if stalls > bounds.stalls_over_200ms:
                out.append(f"{who}: {stalls} {kind} stalls over 200 ms")
    if report.missing:
        out.append(f"processes lost during the window: {report.missing}")
    return out
