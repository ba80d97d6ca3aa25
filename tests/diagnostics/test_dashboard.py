"""The /rechunk-p2p dashboard page and the numbers behind it: served by the scheduler's
dashboard, linked from its menu, and showing an open run's phase and progress, the
workers' bytes and loop lag, and a finished run's totals (in-process clusters; the browser
test is tests/test_dashboard_browser.py)."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import dask.array as da
import numpy as np
import pytest
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.diagnostics.live import (
    CLOSED_PEAKS,
    LAG_INTERVAL,
    LAG_SAMPLES,
    LoopLagWindow,
)
from rechunk_p2p.diagnostics.live_view import live_view
from rechunk_p2p.spec import PLUGIN_NAME

pytest.importorskip("bokeh")
from rechunk_p2p.diagnostics.dashboard import RechunkPage

DASHBOARD = {"dashboard": True, "dashboard_address": ":0"}
_GATE = threading.Event()  # gen_cluster workers run in this process


def _wait_for_gate(block: np.ndarray, block_info=None) -> np.ndarray:
    if block_info[None]["chunk-location"][0] == 0:
        assert _GATE.wait(30), "the test never opened the gate"
    return block


def _gated_rechunk() -> da.Array:
    """64 row blocks of 512 KiB into 64 column blocks; the transfer of row block 0 waits at
    the gate (the others' pieces fill whole messages, which leave before it opens)."""
    x = da.random.RandomState(0).random((256, 16384), chunks=(4, 16384))
    return rechunk_p2p.rechunk(x.map_blocks(_wait_for_gate, dtype=x.dtype), (256, 256)), x


async def _until(predicate, timeout: float = 10.0, what=lambda: "") -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting; {what()}")


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)] * 2,
    scheduler_kwargs=DASHBOARD,
    clean_kwargs={"threads": False},  # the page's server resolves names in the loop's pool
)
async def test_the_page_is_served_and_linked_from_the_menu(c, s, a, b):
    await c.compute(rechunk_p2p.rechunk(da.ones((8, 8), chunks=(1, 8)), (8, 1)).sum())
    url = f"http://127.0.0.1:{s.http_server.port}"
    with ThreadPoolExecutor(1) as pool:  # a blocking client; this loop serves the pages
        page, status = await asyncio.get_running_loop().run_in_executor(pool, _fetch, url)
    assert "bokeh" in page  # the page's document loads over its websocket (the browser test)
    assert 'href="rechunk-p2p"' in status  # in the "More..." menu, as distributed's pages


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], scheduler_kwargs={"dashboard": False})
async def test_a_scheduler_without_a_dashboard_gets_no_page(c, s, a):
    """Its http server still serves /metrics and /health; the page would only cost bokeh's
    import on the scheduler's loop."""
    from rechunk_p2p.diagnostics.dashboard import install

    await c.compute(rechunk_p2p.rechunk(da.ones((8, 8), chunks=(1, 8)), (8, 1)).sum())
    assert s.http_application is not None
    assert not install(s)
    assert not getattr(s, "_rechunk_p2p_page", False)


def _fetch(url: str) -> tuple[str, str]:
    page = urllib.request.urlopen(f"{url}/rechunk-p2p", timeout=30).read().decode()
    status = urllib.request.urlopen(f"{url}/status", timeout=30).read().decode()
    return page, status


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, scheduler_kwargs=DASHBOARD)
async def test_an_open_run_shows_its_phase_progress_and_workers(c, s, a, b):
    _GATE.clear()
    y, x = _gated_rechunk()
    fut = c.compute(y)
    try:
        await _until(lambda: PLUGIN_NAME in s.plugins)
        plugin = s.plugins[PLUGIN_NAME]
        page = RechunkPage(s)
        await _until(lambda: plugin.active and live_view(s, plugin).runs[0].transfers_done > 0)
        # the worker that holds the gated transfer receives the other's pieces meanwhile
        await _until(lambda: any(w.bytes_received > 0 for w in live_view(s, plugin).workers))
        view = live_view(s, plugin)
        (run,) = view.runs
        assert run.phase == "transfers"
        assert run.label.startswith("wait_for_gate ")  # the input's name (map_blocks')
        assert run.transfers == 64 and 0 < run.transfers_done < 64
        assert run.outputs == 64 and run.outputs_done == 0
        assert {w.address for w in view.workers} == {a.address, b.address}
        assert all(w.buffer_limit > 0 and not w.silent for w in view.workers)
        for row, worker in zip(view.workers, sorted([a, b], key=lambda w: w.address)):
            limit = worker.memory_manager.memory_limit or 0  # storage-memory-fraction of it
            assert row.memory_budget == int(limit * 0.25)
        page.update()
        assert page.runs.data["phase"] == ["transfers"]
        assert page.progress.y_range.factors == [run.label]
        # a fixed lag axis, the mark in view whatever the lags
        assert (page.lag.x_range.start, page.lag.x_range.end) == (0, 500)
        assert sorted(page.workers.data["address"]) == sorted([a.address, b.address])
        assert page.summary.text.startswith("<b>1 run(s) open</b>")
    finally:
        _GATE.set()
    result = await fut
    np.testing.assert_array_equal(result, (await c.compute(x)))
    await _until(lambda: not plugin.active)
    # the totals of a finished run come with the workers' next heartbeats, and are what the
    # workers counted when they closed it
    closed = [
        r
        for w in (a, b)
        for r in w.plugins[PLUGIN_NAME].closed_runs()
        if r.shuffle_id == run.shuffle_id
    ]
    assert len(closed) == 2  # one row a worker: the run was not restarted
    counted = (sum(r.bytes_sent for r in closed), sum(r.bytes_received for r in closed))
    await _until(
        lambda: ((row := live_view(s, plugin).runs[0]).bytes_sent, row.bytes_received) == counted,
        what=lambda: f"workers counted {counted}; {live_view(s, plugin)}",
    )
    # every input was cut once and counted: kept where it was cut, or sent once
    assert sum(r.bytes_local + r.bytes_sent for r in closed) == x.nbytes
    assert sum(r.inputs for r in closed) == 64
    (done,) = live_view(s, plugin).runs
    assert done.bytes_sent == done.bytes_received
    assert done.phase == "done"
    assert (done.transfers_done, done.outputs_done) == (64, 64)
    assert done.bytes_memory == done.bytes_disk == 0 and done.workers == 2
    page.update()
    assert page.runs.data["phase"] == ["done"] and page.progress.y_range.factors == []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_workers_send_their_loop_lag_with_every_heartbeat(c, s, a, b):
    await c.compute(rechunk_p2p.rechunk(da.ones((8, 8), chunks=(1, 8)), (8, 1)).sum())
    plugin = s.plugins[PLUGIN_NAME]
    await _until(lambda: all(not w.silent for w in live_view(s, plugin).workers))
    windows = [w.plugins[PLUGIN_NAME].heartbeat.lag for w in (a, b)]
    await _until(lambda: all(len(w.recent) >= 5 for w in windows))
    before = {w.address: w.lag_max_ms for w in live_view(s, plugin).workers}
    assert before[a.address] < 250
    time.sleep(0.3)  # stall the loop (gen_cluster's servers share this one) once

    def shown() -> float:
        return {w.address: w.lag_max_ms for w in live_view(s, plugin).workers}[a.address]

    await _until(lambda: shown() >= 250, timeout=15)


def test_the_lag_window_keeps_the_recent_samples_and_a_histogram():
    window = LoopLagWindow()
    for lag in [0.001] * 198 + [0.03, 0.2]:
        window.add(lag)
    summary = window.summary()
    assert summary["max_ms"] == pytest.approx(200.0)
    assert summary["p99_ms"] == pytest.approx(30.0)
    assert window.buckets[0] == 198 and sum(window.buckets) == 200
    for _ in range(LAG_SAMPLES):  # old samples leave the recent window, not the histogram
        window.add(0.002)
    assert window.summary()["max_ms"] == pytest.approx(2.0)
    assert sum(window.buckets) == 200 + LAG_SAMPLES
    assert LAG_INTERVAL <= 0.1


def test_the_lag_window_keeps_each_runs_maximum_from_its_opening():
    window = LoopLagWindow()
    window.add(0.5)  # before any run: nobody's
    window.open_run("a")
    window.add(0.04)
    window.open_run("b")
    window.add(0.02)
    window.close_run("a")
    window.add(0.3)  # after a closed: b's only
    assert window.peaks_ms() == pytest.approx({"a": 40.0, "b": 300.0})
    for k in range(CLOSED_PEAKS + 3):  # closed runs' maxima are kept, the last ones
        window.open_run(f"c{k}")
        window.close_run(f"c{k}")
    window.close_run("b")
    peaks = window.peaks_ms()
    assert len(peaks) == CLOSED_PEAKS and "b" in peaks and "a" not in peaks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_performance_report_saves_the_runs_of_its_block(c, s, a, b):
    x = da.random.random((64, 64), chunks=(1, 64))
    await c.compute(rechunk_p2p.rechunk(x, (64, 2)).sum())  # before the block: not in it
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/report.html"
        async with rechunk_p2p.performance_report(path, mode="inline"):
            await c.compute(rechunk_p2p.rechunk(x, (64, 4)).sum())
        with open(path) as f:
            text = f.read()
    plugin = s.plugins[PLUGIN_NAME]
    first, second = [f.shuffle_id for f in plugin.finished]
    assert second[:8] in text and first[:8] not in text
    assert "rechunk-p2p-worker-lag" in text  # the page's plots, with their data
    assert "Run report" in text and "<table" in text
    assert "16 / 16" in text  # the run's outputs, all assembled
    with pytest.raises(ValueError, match="mode must be"):
        rechunk_p2p.performance_report("x.html", mode="svg")


def test_a_run_cut_short_shows_why_with_the_workers_and_bytes_it_had():
    """A run closed because a worker left keeps, on the page, the workers and bytes its
    workers' heartbeats told before it closed (they stop telling them once it is closed)."""
    from rechunk_p2p.diagnostics.live_view import FinishedRun, _finished_row

    closed = FinishedRun(
        "abcdef0123-3", 2, "worker tcp://w:1 left", 10.0, 14.5, 48, 48,
        "open_dataset-t2m", 2, 5_000_000, 4_000_000,
    )  # fmt: skip
    row = _finished_row(closed, {})
    assert row.phase == "cut short: worker tcp://w:1 left"
    assert (row.workers, row.bytes_sent, row.bytes_received) == (2, 5_000_000, 4_000_000)
    assert row.label == "open_dataset-t2m abcdef01-3/2" and row.seconds == 4.5
    done = _finished_row(FinishedRun("abcdef0123-3", 2, "barrier released", 0, 1, 4, 4), {})
    assert done.phase == "done" and done.label == "abcdef01-3/2"
