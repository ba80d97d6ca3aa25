"""Pure tests of the loop-lag statistics (histogram, accumulator, report)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.diagnostics.loop_stats import (
    HIST_RATIO,
    DistributedSignals,
    LagAccumulator,
    LoopLagReport,
    bin_index,
    build_report,
    downsample_max,
    histogram_percentile,
    summarise,
)

lags = st.lists(
    st.floats(min_value=0.0, max_value=5e4, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=400,
)


def _oracle(values: list[float], q: float) -> float:
    """The rank-based (inverted-CDF) quantile of the values."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


@settings(max_examples=200, deadline=None)
@given(lags, st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_percentile_is_tight_upper_bound(values: list[float], q: float) -> None:
    acc = LagAccumulator(max_samples=1000)
    for i, v in enumerate(values):
        acc.add(float(i), v)
    got = histogram_percentile(acc.hist, q, acc.max_ms)
    want = _oracle(values, q)
    assert got >= want
    assert got <= max(want * HIST_RATIO, 0.01) + 1e-12
    assert acc.samples == len(values)
    assert acc.max_ms == max(values)
    assert acc.stalls == [sum(v > 50 for v in values), sum(v > 200 for v in values)]


def test_bins_are_monotonic_and_cover_range() -> None:
    xs = np.geomspace(1e-4, 1e6, 5000)
    idx = [bin_index(float(x)) for x in xs]
    assert idx == sorted(idx)
    assert idx[0] == 0


def test_accumulator_caps_timeline_and_keeps_the_worst_lag() -> None:
    acc = LagAccumulator(max_samples=100)
    n = 10_000
    spike_at = 6_789
    for i in range(n):
        acc.add(i * 0.005, 999.0 if i == spike_at else 1.0)
    assert len(acc) < 100
    assert acc.samples == n
    tl = acc.timeline(10_000)
    assert len(tl) <= 101
    # The timeline still spans the whole window and the spike is kept with its time.
    assert tl[0][0] == 0.0
    assert tl[-1][0] > 0.9 * (n - 1) * 0.005
    assert (spike_at * 0.005, 999.0) in tl
    assert [t for t, _ in tl] == sorted(t for t, _ in tl)


def test_downsample_keeps_maxima() -> None:
    t = np.arange(1000) * 0.01
    v = np.ones(1000)
    v[[10, 500, 999]] = [7.0, 9.0, 8.0]
    out = downsample_max(t, v, 50)
    assert len(out) == 50
    assert {lag for _, lag in out} >= {7.0, 9.0, 8.0}
    assert downsample_max(t[:3], v[:3], 50) == tuple(zip(t[:3], v[:3], strict=True))


def _wire(values: list[float]) -> dict:
    acc = LagAccumulator(1000)
    for i, v in enumerate(values):
        acc.add(i * 0.005, v)
    return summarise(acc, 100)


def _signals(kind: str) -> DistributedSignals:
    return DistributedSignals(kind, 10, 20.0, 25.0, 0, 0.0, 3.0)


def test_report_merges_exactly_and_round_trips_through_json() -> None:
    a = [0.5] * 98 + [60.0, 300.0]
    b = [0.2] * 100
    report = build_report(
        {"tcp://a:1": _wire(a), "tcp://s:1": _wire(b)},
        {"tcp://a:1": _signals("Worker"), "tcp://s:1": _signals("Scheduler")},
        interval_ms=5.0,
        duration_s=0.5,
        timeline_points=100,
    )
    assert report.overall.samples == 200
    assert report.overall.max_ms == 300.0
    assert report.overall.stalls_over_50ms == 2
    assert report.overall.stalls_over_200ms == 1
    assert report.per_process["tcp://a:1"].stalls_over_200ms == 1
    assert report.per_process["tcp://s:1"].max_ms == pytest.approx(0.2)
    assert report.overall.p99_ms >= 0.5
    assert list(report.workers()) == ["tcp://a:1"]
    text = json.dumps(report.to_dict())
    back = LoopLagReport.from_dict(json.loads(text))
    assert back == report
    table = str(report)
    assert "tcp://a:1" in table and "scheduler" in table and "overall" in table


def test_empty_process_summary() -> None:
    report = build_report(
        {"w": summarise(LagAccumulator(10), 10)},
        {},
        interval_ms=5.0,
        duration_s=0.0,
        timeline_points=10,
    )
    assert report.per_process["w"].samples == 0
    assert report.per_process["w"].p99_ms == 0.0
    assert "?" in str(report)
