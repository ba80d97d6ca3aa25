"""Loop-lag statistics: the report dataclasses and the arithmetic behind them.

Where it runs: pure. No asyncio, no distributed: plain numbers in, frozen dataclasses out.
The probe (:mod:`rechunk_p2p.diagnostics.loop_probe`) feeds samples into a
:class:`LagAccumulator` on each process; the client merges what the processes send back
into a :class:`LoopLagReport` with :func:`build_report`.

Percentiles come from a fixed log-spaced histogram (bins 2 % wide from 0.01 ms to 100 s),
so memory stays constant however long the window is and processes merge exactly. A
percentile is reported as the upper edge of its bin, clamped to the exact maximum: it is
an upper bound, at most 2 % above the true value.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Lower edge of the first regular histogram bin, in milliseconds.
HIST_LOW_MS = 0.01
#: Ratio between consecutive bin edges (bins are 2 % wide).
HIST_RATIO = 1.02
_LOG_RATIO = math.log(HIST_RATIO)
#: Number of bins: bin 0 holds everything below HIST_LOW_MS, the last bin everything above 100 s.
HIST_BINS = 2 + math.ceil(math.log(1e5 / HIST_LOW_MS) / _LOG_RATIO)

#: Lags above these thresholds count as stalls.
STALL_MS = (50.0, 200.0)


def bin_index(lag_ms: float) -> int:
    """Histogram bin of a lag in milliseconds.

    >>> bin_index(0.0), bin_index(0.01), bin_index(1e9) == HIST_BINS - 1
    (0, 1, True)
    """
    if lag_ms < HIST_LOW_MS:
        return 0
    return min(HIST_BINS - 1, 1 + int(math.log(lag_ms / HIST_LOW_MS) / _LOG_RATIO))


def bin_upper_edge(index: int) -> float:
    """Upper edge in milliseconds of histogram bin ``index``."""
    return HIST_LOW_MS * HIST_RATIO**index


def histogram_percentile(hist: Mapping[int, int], q: float, max_ms: float) -> float:
    """The ``q``-quantile (0 < q <= 1) of a sparse histogram, as an upper bound.

    >>> h = {bin_index(1.0): 99, bin_index(100.0): 1}
    >>> round(histogram_percentile(h, 0.5, 100.0), 1), histogram_percentile(h, 1.0, 100.0)
    (1.0, 100.0)
    """
    total = sum(hist.values())
    if total == 0:
        return 0.0
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(hist):
        seen += hist[index]
        if seen >= rank:
            return min(bin_upper_edge(index), max_ms)
    return max_ms  # pragma: no cover - unreachable, ranks never exceed the total


def downsample_max(
    times: Sequence[float], lags: Sequence[float], max_points: int
) -> tuple[tuple[float, float], ...]:
    """Reduce a timeline to at most ``max_points`` points, keeping each bucket's worst lag.

    Keeping the maximum (and its time) rather than an average keeps stalls visible in plots.

    >>> downsample_max([0, 1, 2, 3], [5.0, 1.0, 1.0, 7.0], 2)
    ((0.0, 5.0), (3.0, 7.0))
    """
    t = np.asarray(times, dtype=np.float64)
    v = np.asarray(lags, dtype=np.float64)
    if len(t) <= max_points:
        return tuple(zip(t.tolist(), v.tolist(), strict=True))
    edges = np.linspace(0, len(t), max_points + 1).astype(np.int64)
    out = []
    for lo, hi in itertools.pairwise(edges):
        if hi > lo:
            k = lo + int(np.argmax(v[lo:hi]))
            out.append((float(t[k]), float(v[k])))
    return tuple(out)


class LagAccumulator:
    """**Loop-confined.** Accumulates lag samples of one process with bounded memory.

    Exact counters (samples, maximum, stalls), a constant-size histogram for percentiles
    and a timeline capped at ``max_samples`` points: when the cap is reached, neighbouring
    points are merged pairwise (keeping the worse lag) and later samples are merged in
    groups of the new stride, so the timeline always covers the whole window.

    Parameters
    ----------
    max_samples
        Upper bound of timeline points kept (rounded up to an even number, at least 2).
    timeline
        Keep a timeline at all (``False``: counters and histogram only).
    """

    __slots__ = (
        "_acc_lag",
        "_acc_n",
        "_acc_t",
        "_keep_timeline",
        "_lags",
        "_stride",
        "_times",
        "hist",
        "max_ms",
        "max_samples",
        "samples",
        "stalls",
    )

    def __init__(self, max_samples: int, timeline: bool = True) -> None:
        self._keep_timeline = timeline
        self.max_samples = max(2, max_samples + (max_samples % 2))
        self.samples = 0
        self.max_ms = 0.0
        self.stalls = [0] * len(STALL_MS)
        self.hist: dict[int, int] = {}
        self._times = array("d")
        self._lags = array("d")
        self._stride = 1
        self._acc_n = 0
        self._acc_t = 0.0
        self._acc_lag = -1.0

    def add(self, t: float, lag_ms: float) -> None:
        """Record one sample: ``t`` seconds since the window began, ``lag_ms`` late."""
        self.samples += 1
        if lag_ms > self.max_ms:
            self.max_ms = lag_ms
        for i, threshold in enumerate(STALL_MS):
            if lag_ms > threshold:
                self.stalls[i] += 1
        b = bin_index(lag_ms)
        self.hist[b] = self.hist.get(b, 0) + 1
        if not self._keep_timeline:
            return
        if lag_ms > self._acc_lag:
            self._acc_t, self._acc_lag = t, lag_ms
        self._acc_n += 1
        if self._acc_n >= self._stride:
            self._times.append(self._acc_t)
            self._lags.append(self._acc_lag)
            self._acc_n, self._acc_lag = 0, -1.0
            if len(self._times) >= self.max_samples:
                self._compact()

    def _compact(self) -> None:
        t = np.frombuffer(self._times, dtype=np.float64).reshape(-1, 2)
        v = np.frombuffer(self._lags, dtype=np.float64).reshape(-1, 2)
        pick = np.argmax(v, axis=1)
        rows = np.arange(len(v))
        new_t, new_v = t[rows, pick].copy(), v[rows, pick].copy()
        del t, v  # release the buffer exports before resizing the arrays
        self._times = array("d", new_t.tobytes())
        self._lags = array("d", new_v.tobytes())
        self._stride *= 2

    def timeline(self, max_points: int) -> tuple[tuple[float, float], ...]:
        """The recorded timeline (including a partial last group), downsampled."""
        times, lags = list(self._times), list(self._lags)
        if self._acc_n:
            times.append(self._acc_t)
            lags.append(self._acc_lag)
        return downsample_max(times, lags, max_points)

    def __len__(self) -> int:
        return len(self._times)


@dataclass(frozen=True)
class LoopLagSummary:
    """**Immutable.** Lag of the callbacks scheduled on one event loop (or all of them).

    Attributes
    ----------
    samples
        Number of probe callbacks that ran.
    p50_ms, p99_ms
        Median and 99th percentile of the lag (upper bounds, within 2 %).
    max_ms
        Worst lag, exact.
    stalls_over_50ms, stalls_over_200ms
        Samples later than 50 ms and 200 ms.
    timeline
        ``(seconds since the window began, lag in ms)`` pairs, downsampled keeping the worst
        lag of each bucket.
    active_s
        Seconds the probe ran on that loop (start and stop reach the processes one after
        the other, so this is a little shorter than the window); summed over processes in
        the overall summary.
    """

    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    stalls_over_50ms: int
    stalls_over_200ms: int
    timeline: tuple[tuple[float, float], ...] = field(default=(), repr=False)
    active_s: float = 0.0


@dataclass(frozen=True)
class DistributedSignals:
    """**Immutable.** distributed's own event-loop health signals of one server, for the window.

    Attributes
    ----------
    server_type
        ``"Worker"``, ``"Scheduler"``, ... (``type(server).__name__``).
    ticks
        ``Server._measure_tick`` calls during the window (one every
        ``distributed.admin.tick.interval``, 20 ms by default, when the loop is healthy).
    tick_mean_ms, tick_max_ms
        Mean and largest ``tick-duration`` (time between two ticks) in the window.
    unresponsive_warnings
        "Event loop was unresponsive" messages logged by this server in the window (emitted
        when a tick takes longer than ``distributed.admin.tick.limit``, 3 s by default).
    unresponsive_max_s
        Longest unresponsive period reported by those messages, in seconds.
    tick_limit_s
        The threshold in force for those messages in that process.
    """

    server_type: str
    ticks: int
    tick_mean_ms: float
    tick_max_ms: float
    unresponsive_warnings: int
    unresponsive_max_s: float
    tick_limit_s: float


@dataclass(frozen=True)
class StallCauses:
    """**Immutable.** Where the time of one process's stalls (samples later than 50 ms) went.

    Attributes
    ----------
    stall_ms
        Total lag of the stalls.
    loop_cpu_ms
        CPU time used by the loop thread during those late intervals (code on the loop).
    runqueue_ms
        Time the loop thread waited for a CPU during them (machine contention);
        ``nan`` where the OS does not report it.
    other_ms
        The rest: waiting for the GIL or blocked in a system call.
    adjusted_p99_ms, adjusted_max_ms, adjusted_stalls_over_200ms
        Lag statistics over all samples after subtracting each interval's run-queue wait.
    stacks
        ``(count, stack)`` of the loop thread caught during stalls, most frequent first
        (empty unless stack capture was asked for).
    gc_collections, gc_full_collections, gc_pause_ms, gc_max_pause_ms
        Garbage collections of the process during the window (all generations, and
        generation 2), their total and longest pause: the GIL is held throughout, so the
        loop cannot run.
    """

    stall_ms: float
    loop_cpu_ms: float
    runqueue_ms: float
    other_ms: float
    adjusted_p99_ms: float
    adjusted_max_ms: float
    adjusted_stalls_over_200ms: int
    stacks: tuple[tuple[int, str], ...] = ()
    gc_collections: int = 0
    gc_full_collections: int = 0
    gc_pause_ms: float = 0.0
    gc_max_pause_ms: float = 0.0


@dataclass(frozen=True)
class LoopLagReport:
    """**Immutable.** Event-loop lag of every probed process over one measurement window.

    Attributes
    ----------
    per_process
        Summary per server address (workers and the scheduler).
    overall
        All samples of all processes merged.
    interval_ms
        Probe interval.
    duration_s
        Length of the window, measured on the client.
    distributed
        distributed's own signals per server address.
    missing
        Addresses probed at the start that could not be read at the end (they left).
    causes
        Per address, where the stalls' time went (loop CPU, run-queue wait, other) and the
        contention-adjusted lag; see :mod:`rechunk_p2p.diagnostics.stall_causes`.
    """

    per_process: dict[str, LoopLagSummary]
    overall: LoopLagSummary
    interval_ms: float
    duration_s: float
    distributed: dict[str, DistributedSignals]
    missing: tuple[str, ...] = ()
    causes: dict[str, StallCauses] = field(default_factory=dict)

    @property
    def unresponsive_warnings(self) -> int:
        """All "Event loop was unresponsive" messages in the window, across servers."""
        return sum(s.unresponsive_warnings for s in self.distributed.values())

    def workers(self) -> dict[str, LoopLagSummary]:
        """The per-process summaries of workers only."""
        return {
            a: s
            for a, s in self.per_process.items()
            if a not in self.distributed or self.distributed[a].server_type != "Scheduler"
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dictionary (tuples become lists under ``json.dumps``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoopLagReport:
        """Rebuild a report from :meth:`to_dict` output (possibly after a JSON round trip)."""

        def summary(s: Mapping[str, Any]) -> LoopLagSummary:
            tl = tuple((float(a), float(b)) for a, b in s.get("timeline", ()))
            return LoopLagSummary(**{**s, "timeline": tl})

        return cls(
            per_process={a: summary(s) for a, s in d["per_process"].items()},
            overall=summary(d["overall"]),
            interval_ms=float(d["interval_ms"]),
            duration_s=float(d["duration_s"]),
            distributed={a: DistributedSignals(**s) for a, s in d["distributed"].items()},
            missing=tuple(d.get("missing", ())),
            causes={
                a: StallCauses(**{**c, "stacks": tuple((int(n), s) for n, s in c["stacks"])})
                for a, c in d.get("causes", {}).items()
            },
        )

    def __str__(self) -> str:
        from rechunk_p2p.diagnostics.report_text import format_report

        return format_report(self)


def summarise(acc: LagAccumulator, timeline_points: int, active_s: float = 0.0) -> dict[str, Any]:
    """The wire form of one process's samples: counters, sparse histogram, timeline."""
    return {
        "active_s": active_s,
        "samples": acc.samples,
        "max_ms": acc.max_ms,
        "stalls": list(acc.stalls),
        "hist": dict(acc.hist),
        "timeline": acc.timeline(timeline_points),
    }


def _summary_from(
    samples: int,
    max_ms: float,
    stalls: Sequence[int],
    hist: Mapping[int, int],
    timeline: tuple[tuple[float, float], ...],
    active_s: float,
) -> LoopLagSummary:
    return LoopLagSummary(
        samples=samples,
        p50_ms=histogram_percentile(hist, 0.50, max_ms),
        p99_ms=histogram_percentile(hist, 0.99, max_ms),
        max_ms=max_ms,
        stalls_over_50ms=stalls[0],
        stalls_over_200ms=stalls[1],
        timeline=timeline,
        active_s=active_s,
    )


def merge_summaries(wires: Iterable[Mapping[str, Any]], timeline_points: int) -> LoopLagSummary:
    """Merge the wire forms of several processes into one summary (exact counters)."""
    samples, max_ms, stalls, active_s = 0, 0.0, [0] * len(STALL_MS), 0.0
    hist: dict[int, int] = {}
    points: list[tuple[float, float]] = []
    for w in wires:
        samples += w["samples"]
        active_s += w.get("active_s", 0.0)
        max_ms = max(max_ms, w["max_ms"])
        stalls = [a + b for a, b in zip(stalls, w["stalls"], strict=True)]
        for k, n in w["hist"].items():
            hist[int(k)] = hist.get(int(k), 0) + n
        points.extend(w["timeline"])
    points.sort()
    timeline = downsample_max([p[0] for p in points], [p[1] for p in points], timeline_points)
    return _summary_from(samples, max_ms, stalls, hist, timeline, active_s)


def build_report(
    wires: Mapping[str, Mapping[str, Any]],
    signals: Mapping[str, DistributedSignals],
    *,
    interval_ms: float,
    duration_s: float,
    timeline_points: int,
    missing: Sequence[str] = (),
    causes: Mapping[str, StallCauses] | None = None,
) -> LoopLagReport:
    """Assemble a :class:`LoopLagReport` from the wire forms of every process."""
    per_process = {
        addr: _summary_from(
            w["samples"], w["max_ms"], w["stalls"], w["hist"], w["timeline"], w.get("active_s", 0.0)
        )
        for addr, w in sorted(wires.items())
    }
    return LoopLagReport(
        per_process=per_process,
        overall=merge_summaries(wires.values(), timeline_points),
        interval_ms=interval_ms,
        duration_s=duration_s,
        distributed=dict(sorted(signals.items())),
        missing=tuple(sorted(missing)),
        causes=dict(sorted((causes or {}).items())),
    )


def _nan_to_zero(v: float) -> float:
    return 0.0 if math.isnan(v) else v


def causes_from_wire(w: Mapping[str, Any]) -> StallCauses:
    """Build :class:`StallCauses` from the wire form a probe sends back."""
    adj = w["adjusted"]
    return StallCauses(
        stall_ms=w["stall_ms"],
        loop_cpu_ms=w["loop_cpu_ms"],
        runqueue_ms=w["runqueue_ms"],
        other_ms=max(0.0, w["stall_ms"] - w["loop_cpu_ms"] - _nan_to_zero(w["runqueue_ms"])),
        adjusted_p99_ms=histogram_percentile(adj["hist"], 0.99, adj["max_ms"]),
        adjusted_max_ms=adj["max_ms"],
        adjusted_stalls_over_200ms=adj["stalls"][1],
        stacks=tuple((int(n), s) for n, s in w["stacks"]),
        gc_collections=w.get("gc_collections", 0),
        gc_full_collections=w.get("gc_full_collections", 0),
        gc_pause_ms=w.get("gc_pause_ms", 0.0),
        gc_max_pause_ms=w.get("gc_max_pause_ms", 0.0),
    )
