"""The dashboard page's "loop max" of a rechunk's runs and the end-of-run summary's
workers' maximum are one figure, measured apart: a stall of a worker's loop while its run
is open shows in both, within their sampling intervals."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import numpy as np
import zarr

from rechunk_p2p.integrations.zarr import rechunk_zarr

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (run on the cluster's servers)

#: The stall injected into a worker's loop
STALL_S = 0.4
#: The page samples a worker's loop every 10 ms, the summary's probe every 5 ms: each sees
#: a stall up to its interval short; the rest is margin
AGREE_MS = 25.0


def _stall_if_open(dask_worker) -> bool:
    """On the worker's loop (a sync function given to ``Client.run``): block it while a
    run is open here (it cannot close meanwhile: runs close on this loop)."""
    from rechunk_p2p.spec import PLUGIN_NAME

    plugin = dask_worker.plugins.get(PLUGIN_NAME)  # (registered as the rechunk starts)
    if plugin is None or not plugin.open_runs():
        return False
    time.sleep(STALL_S)
    return True


def _loop_max_of_finished_runs(dask_scheduler) -> list[float]:
    from rechunk_p2p.diagnostics.live_view import live_view
    from rechunk_p2p.spec import PLUGIN_NAME

    view = live_view(dask_scheduler, dask_scheduler.plugins[PLUGIN_NAME])
    return [r.loop_max_ms for r in view.runs if r.phase == "done"]


def test_the_page_and_the_summary_agree_on_the_workers_loop_maximum(p2p_client, tmp_path):
    src = zarr.create_array(
        tmp_path / "src.zarr", shape=(600, 128, 256), chunks=(1, 128, 256), dtype="f4"
    )
    src[:] = np.random.default_rng(0).random(src.shape, dtype="f4")
    worker = sorted(p2p_client.scheduler_info()["workers"])[0]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            rechunk_zarr,
            tmp_path / "src.zarr",
            tmp_path / "dst.zarr",
            (600, 16, 16),
            progress=False,
        )
        stalled = False
        while not stalled and not running.done():
            stalled = p2p_client.run(_stall_if_open, workers=[worker])[worker]
        report = running.result(timeout=120)
    assert stalled, "the rechunk ended before its run opened on the worker"
    _, worst, workers, _ = report.loop_lag
    assert workers == 2 and worst >= 1000 * STALL_S - 10, report.loop_lag
    deadline = time.monotonic() + 30  # (the workers' heartbeats bring the closed runs)
    while True:
        shown = p2p_client.run_on_scheduler(_loop_max_of_finished_runs)
        if max(shown, default=0.0) >= 1000 * STALL_S - 15 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert shown and abs(max(shown) - worst) <= AGREE_MS, (shown, report.loop_lag)
