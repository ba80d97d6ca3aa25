"""The benchmark command end to end at a tiny size: JSON, medians, table and figure."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from integration import bench


@pytest.mark.slow  # (the benchmark's own run: pytest -m slow integration)
def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--size", "8MiB", "--repeat", "1", "--workloads", "2d", "--out", str(tmp_path)]
    assert bench.main(argv) == 0  # (origins made, made+map and held, the default)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [r["impl"] for r in doc["runs"]] == ["rechunk_p2p", "dask-p2p", "dask-tasks"] * 3
    assert [r["origin"] for r in doc["runs"]] == ["made"] * 3 + ["made+map"] * 3 + ["held"] * 3
    assert [r["workload"] for r in doc["runs"][::3]] == [
        "2d-rows-to-cols",
        "2d-rows-to-cols/made+map",
        "2d-rows-to-cols/held",
    ]
    assert all(r["ok"] for r in doc["runs"]), [r.get("error") for r in doc["runs"]]
    for r in doc["runs"]:
        assert r["wall_s"] > 0
        assert r["lag"]["overall"]["samples"] > 0
        assert len(r["rss_peak_bytes"]) == 2 and min(r["rss_peak_bytes"].values()) > 10 * 2**20
        # both workers generated and moved data while the clock ran
        assert len(r["worker_cpu_s"]) == 2 and min(r["worker_cpu_s"].values()) > 0, r
    assert {m["impl"] for m in doc["medians"]} == set(bench.IMPLEMENTATIONS)
    workers = [
        {a: d for a, d in r["lag"]["distributed"].items() if d["server_type"] != "Scheduler"}
        for r in doc["runs"]
    ]
    assert len({frozenset(w) for w in workers}) == 9, workers  # a fresh cluster per run
    # distributed's "unresponsive" threshold on the workers is the benchmark's 200 ms
    assert {d["tick_limit_s"] for w in workers for d in w.values()} == {0.2}
    assert min(doc["meta"]["reference"].values()) > 0  # the machine's bandwidths
    assert doc["meta"]["data_only_s"]["2d-rows-to-cols"] > 0
    assert doc["meta"]["data_only_s"]["2d-rows-to-cols/made+map"] > 0
    assert doc["meta"]["data_only_s"]["2d-rows-to-cols/held"] == 0  # held before the clock
    engine = doc["runs"][0]["phases_s"]
    assert engine["cut"] > 0 and engine["assemble"] > 0, engine
    for r in doc["runs"]:  # the many-worker figures
        assert r["scheduler_cpu_s"] > 0 and min(r["fds_at_end"].values()) > 0, r
        assert min(r["connections_at_end"].values()) > 0  # at least the scheduler's
        assert 0 < sum(r["task_cpu_s"].values()) <= sum(r["worker_cpu_s"].values()) + 0.5
        # idle workers take some CPU (heartbeats), and far from a core each
        assert set(r["idle_cpu_cores"]) == set(r["worker_cpu_s"]), r
        assert 0 <= sum(r["idle_cpu_cores"].values()) < len(r["idle_cpu_cores"]) * 0.5, r
        if r["impl"] != "dask-tasks":  # (no transfer or barrier there)
            # (workers' task times, on the scheduler's clock by distributed's estimate of
            # each worker's offset, from the middle of a heartbeat's round trip: off by up
            # to half of one; 0.14 s seen while the default test run loaded the machine, and
            # 0.53 s past the wall in a fresh clone's .ci/run)
            slack = 1.5
            assert -slack <= r["to_first_transfer_s"] < r["wall_s"] + slack, r
            assert -slack <= r["barrier_to_last_output_s"] < r["wall_s"] + slack, r
    ours = [r for r in doc["runs"] if r["impl"] == "rechunk_p2p"]
    assert all(r["messages_sent"] > 0 and r["bytes_sent"] > 0 for r in ours)
    assert doc["runs"][1]["phases_s"] is None  # dask's own methods have no engine phases
    out = capsys.readouterr().out
    assert "2d-rows-to-cols" in out and "wall s" in out
    assert any(line.split()[:2] == ["2d-rows-to-cols", "held"] for line in out.splitlines())
    assert "rechunk_p2p per phase" in out and "floor/wall" in out
    assert "rechunk_p2p / other" in out and "dask-tasks" in out.split("rechunk_p2p / other")[1]
    ratios = out.split("rechunk_p2p / other")[1].splitlines()
    assert "CPU" in ratios[1] and ratios[2].count("x") == 3, ratios[:3]  # wall, rechunk, CPU
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_bench_persisted_outputs_are_checked_after_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--outputs persisted`` (the default) a wrong rechunk is a failed run."""
    from integration import workloads

    args = bench.parse_args(["--size", "4MiB", "--workloads", "2d"])
    assert args.outputs == "persisted"
    w = bench.workloads_for(args)[0]
    with bench.cluster_client(args, str(tmp_path)) as client:
        good = bench.run_one(client, "dask-tasks", w, args)
        assert good["ok"] and good["error"] is None and good["wall_s"] > 0, good
        assert bench.data_only_seconds(client, w) > 0
        assert bench.data_only_seconds(client, replace(w, origin="derived")) > 0
        real = workloads.rechunk_with
        # an implementation that misplaces elements: found after the clock stops
        monkeypatch.setattr(
            workloads,
            "rechunk_with",
            lambda impl, x, chunks: real(impl, x, chunks).map_blocks(lambda b: b[::-1]),
        )
        bad = bench.run_one(client, "dask-tasks", w, args)
    assert not bad["ok"] and bad["error"] == "wrong values in the outputs", bad


def test_floor_counts_two_copies_the_cross_worker_share_and_the_spill() -> None:
    from integration.reference import Reference, floor_seconds

    ref = Reference(memcpy=4e9, loopback=2e9, page_cache_write=2e9, page_cache_read=4e9)
    assert floor_seconds(ref, 4 * 10**9, workers=2, disk=False) == pytest.approx(2.0)
    assert floor_seconds(ref, 4 * 10**9, workers=2, disk=True) == pytest.approx(3.5)
    assert floor_seconds(ref, 4 * 10**9, workers=1, disk=False) == pytest.approx(2.0)


def test_scaling_figure_from_points(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from integration.scaling import plot

    points = [
        {"sweep": sweep, "impl": impl, "size": size, "workers": workers,
         "wall_s": 1.0 + size / 2**30, "rss_peak": 2**28 * workers}
        for impl in ("rechunk_p2p", "dask-p2p")
        for sweep, size, workers in [("bytes", 2**28, 2), ("bytes", 2**30, 2),
                                     ("workers", 2**30, 2), ("workers", 2**30, 4)]
    ]  # fmt: skip
    figure = plot(points, tmp_path / "scaling.png", "test")
    assert figure.stat().st_size > 10_000


@pytest.mark.slow
def test_larger_than_memory_without_pausing_a_worker(tmp_path: Path) -> None:
    """6 GiB through two workers of 2 GiB into zarr: right result, no worker paused or
    restarted by distributed's memory monitor (about a minute)."""
    from integration import bench_large

    argv = ["--repeat", "1", "--impls", "rechunk_p2p", "--out", str(tmp_path)]
    assert bench_large.main(argv) == 0
    (run,) = json.loads((tmp_path / "bench-large.json").read_text())["runs"]
    assert run["ok"] and run["most_paused"] == 0 and run["restarted"] == 0, run
    assert run["rss_peak_bytes"] < 2 * 2**30
    assert run["spilled_bytes"] > 2 * 2**30  # auto chose disk: the data do not fit


@pytest.mark.slow  # (the benchmark's own run: pytest -m slow integration)
def test_larger_than_memory_command_small(tmp_path: Path) -> None:
    """The larger-than-memory benchmark's mechanics at a tiny size: zarr written, read back
    and checked, workers' health recorded."""
    from integration import bench_large

    def scratch_dirs() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("rechunk-bench-large-*"))

    before = scratch_dirs()
    argv = ["--size", "16MiB", "--repeat", "1", "--memory-limit", "1GiB", "--out", str(tmp_path)]
    assert bench_large.main(argv) == 0
    runs = json.loads((tmp_path / "bench-large.json").read_text())["runs"]
    assert [r["impl"] for r in runs] == ["rechunk_p2p", "dask-p2p"]
    for r in runs:
        assert r["ok"] and r["error"] is None, r
        assert (r["most_paused"], r["restarted"]) == (0, 0)
        assert r["wall_s"] > 0 and r["rss_peak_bytes"] > 10 * 2**20
        assert r["worker_cpu_s"] > 0, r
    assert scratch_dirs() <= before  # its stores and worker directories are gone


def test_cpu_times_of_one_rechunk(capsys: pytest.CaptureFixture[str]) -> None:
    from integration import cpu_times

    cpu_times.main(["--workload", "2d128", "--size", "8MiB", "--runs", "1"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("[0] 2d128 rechunk_p2p wall ")
    figures = [
        float(v)
        for v in line.split("cpu user + sys s: ")[1].replace("+", " ").split()
        if v[0].isdigit()
    ]
    assert len(figures) == 6 and figures[0] + figures[2] > 0  # the workers worked


def test_resource_sampler_measures_until_stop(tmp_path: Path) -> None:
    """The window ends at ``stop`` (where the benchmark's clock stops), not when the block
    is left: CPU burnt and memory taken after it (checking the outputs) are not counted."""
    import os

    import numpy as np
    import psutil

    from integration.resources import ResourceSampler

    me = psutil.Process()

    def burn(seconds: float) -> None:
        start = sum(me.cpu_times()[:2])
        while sum(me.cpu_times()[:2]) - start < seconds:
            sum(range(10_000))

    with ResourceSampler({"me": os.getpid()}, {"me": str(tmp_path)}) as sampler:
        burn(0.2)
        sampler.stop()
        before = me.memory_info().rss
        held = np.ones(256 * 2**20, dtype=np.uint8)  # touched: resident
        burn(0.6)
        assert me.memory_info().rss > before + 200 * 2**20
    peaks = sampler.peaks()
    del held
    assert 0.2 <= peaks.cpu_seconds["me"] < 0.6, peaks
    assert peaks.rss_bytes["me"] < before + 100 * 2**20, (peaks, before)


@pytest.mark.slow  # (the benchmark's own run: pytest -m slow integration)
def test_many_workers_sweep_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two worker counts, weak scaling, one run each: every figure of every point."""
    from integration import many_workers

    argv = [
        "--workers", "2,3", "--workloads", "2d128", "--per-worker", "4MiB", "--sweeps", "weak",
        "--repeat", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert many_workers.main(argv) == 0
    points = json.loads((tmp_path / "many_workers.json").read_text())["points"]
    assert [(p["workers"], p["impl"]) for p in points] == [
        (2, "rechunk_p2p"), (2, "dask-p2p"), (3, "rechunk_p2p"), (3, "dask-p2p"),
    ]  # fmt: skip
    assert [p["size"] for p in points] == [8 * 2**20] * 2 + [12 * 2**20] * 2
    for p in points:
        assert p["wall_s"] > 0 and p["cpu_s"] > 0 and p["scheduler_cpu_s"] > 0, p
        assert p["connections"] > 0 and p["fds"] > 0 and p["rss_peak"] > 0
        assert p["probe_interval_ms"] == 20.0, p  # (the single benchmark's default: 5 ms)
    assert all(p["messages"] > 0 for p in points if p["impl"] == "rechunk_p2p")
    out = capsys.readouterr().out
    assert "rechunk_p2p / other" in out and "3 workers vs dask-p2p" in out
    assert "rechunk_p2p    3 vs   2 workers" in out
    for p in points:  # (the workers' idle CPU over the run's wall taken off)
        assert 0 < p["cpu_above_idle_s"] <= p["cpu_s"], p
        (run,) = p["per_run"]  # the raw figures of the one run are its medians
        assert run == {k: p[k] for k in many_workers.RUN_FIGURES}, p
        assert p["errors"] == [], p
    assert "each run: wall s" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "many_workers.png").stat().st_size > 10_000


def test_many_workers_reports_a_failed_implementation() -> None:
    """An implementation whose every run failed at a count stays in the sweep's output, with
    its error, and the ratios and growth skip it instead of failing."""
    from integration import many_workers

    def pt(impl: str, workers: int, wall: float | None, error: str | None = None) -> dict:
        base = {"sweep": "strong", "workload": "w", "workers": workers, "impl": impl}
        if wall is None:
            return base | {"runs": 0, "failed": 1, "per_run": [{"error": error}], "errors": [error]}
        figures = {"wall_s": wall, "cpu_s": 2 * wall, "cpu_above_idle_s": wall}
        return base | {"runs": 1, "failed": 0, **figures, "per_run": [figures], "errors": []}

    points = [
        pt("rechunk_p2p", 4, 1.0),
        pt("dask-p2p", 4, 2.0),
        pt("rechunk_p2p", 64, 3.0),
        pt("dask-p2p", 64, None, "KilledWorker: all those workers died"),
    ]
    ratios = many_workers.format_ratios(points, ["rechunk_p2p", "dask-p2p"])
    assert "4 workers vs dask-p2p: wall 0.50x  CPU 0.50x" in ratios
    assert "64 workers vs dask-p2p: dask-p2p failed (KilledWorker" in ratios
    growth = many_workers.format_growth(points)
    assert "rechunk_p2p   64 vs   4 workers: 3.00x, 3.00x" in growth
    assert not any("dask-p2p" in line and " 64 vs" in line for line in growth.splitlines())
    runs = many_workers.format_runs(points)
    assert "64 dask-p2p     failed" in runs and "64 rechunk_p2p  3.00 / 6.00 / 3.00" in runs
    assert "nan" in many_workers.format_points(points)  # (no figures for the failed one)


@pytest.mark.slow  # (the benchmark's own run: pytest -m slow integration)
def test_era5_command_small(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """``integration.bench_era5``: each step, both implementations, each with wall, first
    task and peaks; the ratios after; the store kept where asked (a fresh cluster a run:
    one origin here)."""
    from integration import bench_era5

    argv = ["--hours", "96", "--repeat", "1", "--steps", "none,astype(float32)"]
    bench_era5.main([*argv, "--origins", "zarr", "--store-dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| hours | origin | step | implementation | wall s | first task s")
    rows = [line for line in lines[2:] if line.startswith("| ")]
    assert [tuple(r.split(" | ")[1:4]) for r in rows] == [
        ("zarr", f"`{s}`", i)
        for s in ("none", "astype(float32)")
        for i in ("rechunk_p2p", "dask p2p")
    ]
    for row in rows:
        wall, first, client, worker = row.split(" | ")[4:8]
        assert float(first.split()[0]) < float(wall.split()[0]), row
        assert float(client.split()[0]) > 50 and float(worker.split()[0]) > 50, row
    assert sum("vs dask p2p: " in line and line.endswith("x") for line in lines) == 2
    assert rows[2].split(" | ")[8].endswith("x")  # (the step's wall over the plain read's)
    assert (tmp_path / "era5-96h.zarr" / "zarr.json").exists()


def test_era5_command_refuses_bad_arguments() -> None:
    from integration import bench_era5

    for argv, says in [
        (["--hours", "0"], "positive"),
        (["--hours", "1.5"], "whole numbers"),
        (["--origins", "held"], "unknown origins"),
        (["--steps", ""], "unknown steps"),
    ]:
        with pytest.raises(SystemExit, match=says):
            bench_era5.main(argv)


@pytest.mark.slow  # (the benchmark's own run: pytest -m slow integration)
def test_elastic_command_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from integration import bench_elastic

    argv = ["--days", "64", "--repeat", "1", "--origins", "held", "--out", str(tmp_path)]
    assert bench_elastic.main(argv) == 0  # every output checked
    (path,) = tmp_path.glob("elastic-*.json")
    runs = json.loads(path.read_text())["results"]
    assert [(r["scenario"], r["impl"]) for r in runs] == [
        ("grow", "rechunk_p2p"),
        ("grow", "dask-p2p"),
        ("four", "rechunk_p2p"),
        ("four", "dask-p2p"),
    ]
    for r in runs:
        assert r["wall_s"] > 0 and r["first_worker_rss"] > 10 * 2**20, r
        assert 0.25 <= r["largest_share"] <= 1.0, r
    four = [r for r in runs if r["scenario"] == "four"]
    assert all(r["holders"] == 4 for r in four), four  # 4 workers from the start: all hold
    assert "| four | held | rechunk_p2p |" in capsys.readouterr().out


def test_elastic_table_gives_the_median_of_each_row() -> None:
    from integration.bench_elastic import table

    row = {"scenario": "grow", "origin": "made", "impl": "rechunk_p2p", "holders": 4}
    rows = [
        {**row, "wall_s": w, "largest_share": s, "first_worker_rss": m, "joined": 3}
        for w, s, m in [(10.0, 0.25, 2**30), (14.0, 0.35, 3 * 2**30)]
    ]
    line = table(rows).splitlines()[2]
    assert line == "| grow | made | rechunk_p2p | 12.0 (10.0 / 14.0) | 0.30 | 4 | 2.00 GiB | 3 |"
