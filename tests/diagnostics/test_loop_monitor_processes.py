"""measure_event_loops on a multi-process LocalCluster (one worker stalls, the other does not)."""

from __future__ import annotations

import json
import time

import pytest
from distributed import Client, LocalCluster

from rechunk_p2p.diagnostics import LoopLagReport, loop_probe, measure_event_loops


def _stall(seconds: float) -> None:
    # Sync functions given to Client.run execute on the worker's event loop.
    time.sleep(seconds)


def _spin(seconds: float) -> None:
    # Keeps the worker's loop thread busy on the CPU (code running on the loop).
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _clean(holdings: dict) -> bool:
    empty = {"probes": [], "filter": False, "logger_filters": 0, "gc_callback": False}
    return all(h == empty for h in holdings.values())


@pytest.fixture(scope="module")
def process_client():
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        # A server's first tick-duration counts from its creation: let every server tick once
        # before any window opens.
        time.sleep(0.2)
        yield client


def test_stall_on_one_worker_shows_only_there(process_client: Client) -> None:
    c = process_client
    a, b = sorted(c.scheduler_info()["workers"])
    t0 = time.monotonic()
    with measure_event_loops(c, interval="5ms") as probe:
        assert probe.report is None
        time.sleep(0.3)
        c.run(_stall, 0.3, workers=[a])
        time.sleep(0.3)
    elapsed = time.monotonic() - t0
    report = probe.report
    assert isinstance(report, LoopLagReport)
    scheduler = c.scheduler.address
    assert set(report.per_process) == {a, b, scheduler}
    stalled, calm = report.per_process[a], report.per_process[b]
    assert 290 <= stalled.max_ms <= 1500
    assert stalled.stalls_over_200ms == 1
    assert stalled.stalls_over_50ms >= 1
    assert calm.stalls_over_200ms == 0
    assert calm.max_ms < 200
    assert report.per_process[scheduler].stalls_over_200ms == 0
    assert report.overall.max_ms == stalled.max_ms
    # The stall shows in the timeline, at roughly the right time.
    worst_t, worst_lag = max(stalled.timeline, key=lambda p: p[1])
    assert worst_lag == stalled.max_ms
    assert 0.2 <= worst_t <= elapsed
    # Plausible sample counts: at most one per interval while the probe ran; on a calm loop,
    # one per interval plus the (small) lag.
    assert report.duration_s == pytest.approx(elapsed, abs=0.2)
    for s in report.per_process.values():
        assert 0 < s.active_s <= report.duration_s + 0.5
        assert s.samples <= s.active_s / 0.005 + 1
    mean_period = calm.active_s / calm.samples
    assert 0.005 <= mean_period <= 0.005 + 2 * calm.p99_ms / 1000 + 0.001
    # distributed's tick metric saw the stall on the stalled worker only.
    assert report.distributed[a].server_type == "Worker"
    assert report.distributed[scheduler].server_type == "Scheduler"
    # (Not asserted for the calm worker: a server's first tick counts from its creation,
    # and on a loaded machine distributed's tick can be late on its own.)
    assert report.distributed[a].tick_max_ms >= 290
    assert report.distributed[b].ticks >= 10
    assert report.unresponsive_warnings == 0
    # Nothing left behind on any process; the report is JSON-serialisable.
    assert _clean(c.run(loop_probe.active_probes))
    assert _clean({"s": c.run_on_scheduler(loop_probe.active_probes)})
    assert LoopLagReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_stall_causes_and_stacks(process_client: Client) -> None:
    c = process_client
    a, b = sorted(c.scheduler_info()["workers"])
    # Unpickling _spin and _stall imports this module on the workers, on their loops: done
    # inside the probe, on a busy machine that import is a stall of its own, which runs
    # straight into the measured one and is caught in its place (one catch per stall).
    c.run(_spin, 0.0)
    c.run(_stall, 0.0)
    # One second per stall: the watchdog samples every 50 ms, so even on a busy machine,
    # where its thread waits for a core, it catches each loop inside the blocking function.
    with measure_event_loops(c, capture_stacks="50ms") as probe:
        c.run(_spin, 1.0, workers=[a])
        c.run(_stall, 1.0, workers=[b])
        time.sleep(0.05)
    causes = probe.report.causes
    spun, slept = causes[a], causes[b]
    # The spinning loop used the CPU itself (or waited for one on a busy machine) ...
    assert spun.stall_ms >= 950
    assert spun.loop_cpu_ms + spun.runqueue_ms >= 800
    # (a little GIL wait behind the worker's other threads is normal on a busy machine)
    assert spun.other_ms < (spun.loop_cpu_ms + spun.runqueue_ms) / 2
    # ... the sleeping loop did neither.
    assert slept.stall_ms >= 950
    assert slept.other_ms >= 700
    assert slept.loop_cpu_ms < slept.other_ms / 2
    assert slept.adjusted_max_ms >= 800
    # The watchdog caught each loop inside the function that blocked it.
    assert any("_spin" in stack for _, stack in spun.stacks), spun.stacks
    assert any("_stall" in stack for _, stack in slept.stacks)
    assert "loop stack caught" in str(probe.report)
    assert LoopLagReport.from_dict(json.loads(json.dumps(probe.report.to_dict()))) == probe.report
    assert _clean(c.run(loop_probe.active_probes))


def _garbage(n: int) -> None:
    import gc

    junk = [[i] for i in range(n)]
    gc.collect()
    del junk


def test_gc_pauses_are_timed(process_client: Client) -> None:
    c = process_client
    a, b = sorted(c.scheduler_info()["workers"])
    with measure_event_loops(c) as probe:
        c.run(_garbage, 2_000_000, workers=[a])
        time.sleep(0.3)  # the probe's late sample runs after the stall, before the window ends
    spent, idle = probe.report.causes[a], probe.report.causes[b]
    assert spent.gc_full_collections >= 1
    assert spent.gc_max_pause_ms > 5
    assert spent.gc_pause_ms >= spent.gc_max_pause_ms
    assert idle.gc_pause_ms < spent.gc_pause_ms
    assert "GC:" in str(probe.report)
    assert _clean(c.run(loop_probe.active_probes))


def _watchdog_threads() -> int:
    import threading

    return sum(t.name == "rechunk-p2p-stall-watchdog" for t in threading.enumerate())


def test_watchdog_threads_end_with_the_window(process_client: Client) -> None:
    c = process_client
    with measure_event_loops(c, capture_stacks="100ms"):
        assert set(c.run(_watchdog_threads).values()) == {1}
    assert set(c.run(_watchdog_threads).values()) == {0}
    assert c.run_on_scheduler(_watchdog_threads) == 0


def test_cleanup_when_the_block_raises(process_client: Client) -> None:
    c = process_client
    with pytest.raises(ZeroDivisionError), measure_event_loops(c) as probe:
        time.sleep(0.05)
        1 / 0  # noqa: B018
    assert probe.report is not None
    assert probe.report.overall.samples > 0
    assert _clean(c.run(loop_probe.active_probes))
    assert _clean({"s": c.run_on_scheduler(loop_probe.active_probes)})


def test_tick_metric_restored_after_window(process_client: Client) -> None:
    def set_max(value: float, dask_worker=None) -> None:
        dask_worker.digests_max["tick-duration"] = value

    def get_max(dask_worker=None) -> float:
        return dask_worker.digests_max["tick-duration"]

    c = process_client
    c.run(set_max, 123.0)
    with measure_event_loops(c) as probe:
        time.sleep(0.1)
    assert all(v == 123.0 for v in c.run(get_max).values())
    # The window reports its own maximum, not the 123 s set before it.
    assert all(s.tick_max_ms < 1000 for s in probe.report.distributed.values())
