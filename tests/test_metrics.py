"""The engine's Prometheus metrics: registered by the scheduler and every worker plugin,
scraped from a real worker's ``/metrics`` over HTTP and parsed with ``prometheus_client``'s
own parser."""

from __future__ import annotations

import asyncio
import urllib.request

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_cluster

import rechunk_p2p

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of every engine sample in ``text``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("rechunk_p2p")
        for s in family.samples
    }


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_every_worker_serves_its_totals(c, s, a, b):
    x = da.random.random((64, 64), chunks=(1, 64))
    before = samples(prometheus_client.generate_latest().decode())
    y = await c.compute(rechunk_p2p.rechunk(x, (64, 4)).sum())
    assert np.isfinite(y)
    for _ in range(100):  # the runs close just after the result (their close messages)
        after = samples(prometheus_client.generate_latest().decode())
        if not any(v for (n, _), v in after.items() if n.endswith("runs_open")):
            break
        await asyncio.sleep(0.05)
    for w in (a, b):  # every worker took part (which one cut or sent what varies)
        key = (("worker", w.address),)
        assert after[("rechunk_p2p_runs_total", key)] >= 1
        assert after[("rechunk_p2p_runs_open", key)] == 0
        assert after[("rechunk_p2p_bytes_queued", key)] == 0  # every send delivered
        phases = {dict(k)["phase"] for n, k in after if n == "rechunk_p2p_phase_seconds_total"}
        assert phases == {"cut", "queue_wait", "send", "store", "assemble"}
    total = {
        name: sum(v for (n, _), v in after.items() if n == name)
        - sum(v for (n, _), v in before.items() if n == name)
        for name in ("rechunk_p2p_bytes_sent_total", "rechunk_p2p_phase_seconds_total")
    }
    assert total["rechunk_p2p_bytes_sent_total"] > 0
    assert total["rechunk_p2p_phase_seconds_total"] > 0
    on_scheduler = (("scheduler", s.address),)
    assert after[("rechunk_p2p_scheduler_runs_created_total", on_scheduler)] >= 1
    sent = sum(v for (n, _), v in after.items() if n == "rechunk_p2p_bytes_sent_total")
    received = sum(v for (n, _), v in after.items() if n == "rechunk_p2p_bytes_received_total")
    assert sent == received


def test_a_worker_process_metrics_endpoint_parses():
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        x = da.random.random((32, 32), chunks=(1, 32))
        rechunk_p2p.rechunk(x, (32, 4)).sum().compute()
        (info,) = client.scheduler_info(n_workers=-1)["workers"].values()
        port = info["services"]["dashboard"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    found = samples(text)
    names = {name for name, _ in found}
    assert {"rechunk_p2p_runs_total", "rechunk_p2p_bytes_spilled_total"} <= names
    assert "rechunk_p2p_phase_seconds_total" in names
    assert sum(v for (n, _), v in found.items() if n == "rechunk_p2p_runs_total") >= 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_the_run_report_lists_each_run_with_its_workers(c, s, a, b):
    x = da.random.random((64, 64), chunks=(1, 64))
    await c.compute(rechunk_p2p.rechunk(x, (64, 4)).sum())
    await c.compute(rechunk_p2p.rechunk(x + 1, (64, 8)).sum())
    for _ in range(100):  # the runs close just after the results
        report = await rechunk_p2p.report(c)
        if len(report.runs) == 2 and not any(r.open for r in report.runs):
            break
        await asyncio.sleep(0.05)
    assert len(report.runs) == 2 and not any(r.open for r in report.runs)
    assert len({r.shuffle_id for r in report.runs}) == 2
    for run in report.runs:
        assert set(run.received) == {a.address, b.address}
        assert run.inputs == 64 and run.outputs in (16, 8)
        assert sum(run.received.values()) == run.bytes_sent > 0
        received = list(run.received.values())
        assert run.balance == pytest.approx(max(received) / (sum(received) / 2))
        assert run.phases["cut"] > 0
    text = str(report)
    assert text.splitlines()[0].split()[:3] == ["rechunk", "run", "workers"]
    assert all(r.shuffle_id in text for r in report.runs)
    assert "<table" in report._repr_html_()


def _boom(block: np.ndarray, block_info=None) -> np.ndarray:
    if block_info[None]["chunk-location"][0] == 3:
        raise ZeroDivisionError("input chunk 3 cannot be made")
    return block


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_loop_lag_histogram_and_errors_by_type(c, s, a, b):
    x = da.ones((16, 16), chunks=(1, 16))
    await c.compute(rechunk_p2p.rechunk(x, (16, 1)).sum())
    bad = rechunk_p2p.rechunk(x.map_blocks(_boom, dtype=x.dtype), (16, 1))
    with pytest.raises(ZeroDivisionError, match="chunk 3"):
        await c.compute(bad.sum())
    found = samples(prometheus_client.generate_latest().decode())
    for w in (a, b):  # a cumulative histogram per worker, its count the +Inf bucket
        key = ("worker", w.address)
        buckets = sorted(
            (float(dict(k)["le"]), v)
            for (n, k), v in found.items()
            if n == "rechunk_p2p_event_loop_lag_seconds_bucket" and key in k
        )
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == float("inf") and counts == sorted(counts) and counts[-1] > 0
        assert found[("rechunk_p2p_event_loop_lag_seconds_count", (key,))] == counts[-1]
    errors = {
        dict(k)["type"]: v
        for (n, k), v in found.items()
        if n == "rechunk_p2p_scheduler_task_errors_total"
    }
    assert errors.get("ZeroDivisionError", 0) >= 1, errors
