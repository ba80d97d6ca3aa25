"""measure_event_loops with gen_cluster (one shared loop) and a threaded LocalCluster."""

from __future__ import annotations

import asyncio
import logging
import time

import distributed.core
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import captured_logger, gen_cluster

from rechunk_p2p.diagnostics import gc_pauses, loop_probe, measure_event_loops
from rechunk_p2p.errors import ClusterError, RechunkInputError, RechunkTypeError


def _stall(seconds: float) -> None:
    # Sync functions given to Client.run execute on the worker's event loop.
    time.sleep(seconds)


def test_async_client_needs_async_with_and_bad_interval() -> None:
    with pytest.raises(RechunkInputError):
        measure_event_loops(object(), interval="0ms")

    class FakeAsync:
        asynchronous = True

    with pytest.raises(RechunkTypeError), measure_event_loops(FakeAsync()):
        pass


@gen_cluster(client=True)
async def test_gen_cluster_shared_loop(c, s, a, b) -> None:
    async with measure_event_loops(c, interval="2ms") as probe:
        time.sleep(0.25)  # blocks the one loop everything shares
        await c.run(_stall, 0.01)
    report = probe.report
    assert set(report.per_process) == {s.address, a.address, b.address}
    for summary in report.per_process.values():
        assert summary.samples > 0
        assert summary.max_ms >= 200
        assert summary.stalls_over_200ms == 1
    assert report.overall.samples == sum(x.samples for x in report.per_process.values())
    assert not loop_probe._PROBES
    assert loop_probe._FILTER is None
    assert not gc_pauses.installed()


@gen_cluster(client=True, config={"distributed.admin.tick.interval": "20ms"})
async def test_unresponsive_warnings_attributed_per_server(c, s, a, b, monkeypatch) -> None:
    monkeypatch.setattr(distributed.core, "tick_maximum_delay", 0.1)
    log = logging.getLogger("distributed.core")
    filters_before = list(log.filters)
    with captured_logger("distributed.core", level=logging.INFO) as sio:
        async with measure_event_loops(c) as probe:
            await c.run(_stall, 0.05)  # wake-up: let every server tick once
            time.sleep(0.3)
            await c.run(_stall, 0.0)
    logged = sio.getvalue().count("Event loop was unresponsive")
    report = probe.report
    assert logged >= 3
    # every warning the probe counted was logged; one logged as the probe stopped (a loaded
    # machine delays a tick past its end) is not counted
    assert 3 <= report.unresponsive_warnings <= logged
    for addr in (s.address, a.address, b.address):
        sig = report.distributed[addr]
        assert sig.unresponsive_warnings >= 1
        assert sig.unresponsive_max_s >= 0.25
        assert sig.tick_limit_s == 0.1
    assert log.filters == filters_before


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_failed_start_cleans_up(c, s, a, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise OSError("injected")

    monkeypatch.setattr(loop_probe, "start_on_worker", broken)
    with pytest.raises(ClusterError, match="injected"):
        async with measure_event_loops(c):
            pass
    assert not loop_probe._PROBES
    assert loop_probe._FILTER is None
    assert not gc_pauses.installed()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_scheduler_refusing_the_probe_is_a_cluster_error(c, s, a, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'rechunk_p2p'")

    monkeypatch.setattr(loop_probe, "start_on_scheduler", broken)
    with pytest.raises(ClusterError, match="importable"):
        async with measure_event_loops(c):
            pass
    assert not loop_probe._PROBES
    assert loop_probe._FILTER is None


@gen_cluster(client=True)
async def test_worker_leaving_is_reported_missing(c, s, a, b) -> None:
    async with measure_event_loops(c) as probe:
        await b.close()
    assert probe.report.missing == (b.address,)
    assert b.address not in probe.report.per_process
    assert a.address in probe.report.per_process
    # The closed worker's probe notices on its next sample and removes itself.
    for _ in range(100):
        if not loop_probe._PROBES:
            break
        await asyncio.sleep(0.01)
    assert not loop_probe._PROBES
    assert loop_probe._FILTER is None
    assert not gc_pauses.installed()


def test_threaded_local_cluster() -> None:
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        with measure_event_loops(c) as probe:
            c.submit(sum, [1, 2]).result()
            time.sleep(0.1)
        assert len(probe.report.per_process) == 3
        assert all(x.samples > 5 for x in probe.report.per_process.values())
        assert not loop_probe._PROBES
        assert loop_probe._FILTER is None
    assert not gc_pauses.installed()
