"""The engine's part of a worker's heartbeat survives the plugin going away mid-beat."""

from __future__ import annotations

import asyncio
import threading

import dask.array as da
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.diagnostics import live
from rechunk_p2p.spec import PLUGIN_NAME


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_heartbeat_in_flight_survives_the_plugin_being_removed(c, s, a, monkeypatch):
    await c.compute(rechunk_p2p.rechunk(da.ones((8, 8), chunks=(1, 8)), (8, 1)).sum())
    entered, release = threading.Event(), threading.Event()
    real = live.heartbeat_blocking

    def held(plugin, lag, peaks):  # a beat that waits in its thread until the plugin is gone
        entered.set()
        assert release.wait(10)
        return real(plugin, lag, peaks)

    monkeypatch.setattr(live, "heartbeat_blocking", held)
    beat = asyncio.create_task(a.get_metrics())
    while not entered.is_set():
        await asyncio.sleep(0.01)
    a.plugins[PLUGIN_NAME].heartbeat.uninstall(a)  # as the plugin's teardown does
    release.set()
    metrics = await beat  # iterating worker.metrics, which must not have changed size
    assert metrics[live.METRIC]["runs"] == []
    assert a.metrics[live.METRIC](a) == {}  # nothing more to report
