"""The benchmark command end to end at a tiny size: JSON, medians, table and figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration import bench


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--size", "8MiB", "--repeat", "1", "--workloads", "2d", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [r["impl"] for r in doc["runs"]] == ["rechunk_p2p", "dask-p2p", "dask-tasks"]
    assert all(r["ok"] for r in doc["runs"]), [r.get("error") for r in doc["runs"]]
    for r in doc["runs"]:
        assert r["wall_s"] > 0
        assert r["lag"]["overall"]["samples"] > 0
        assert len(r["rss_peak_bytes"]) == 2 and min(r["rss_peak_bytes"].values()) > 10 * 2**20
    assert {m["impl"] for m in doc["medians"]} == set(bench.IMPLEMENTATIONS)
    assert min(doc["meta"]["reference"].values()) > 0  # the machine's bandwidths
    assert doc["meta"]["data_only_s"]["2d-rows-to-cols"] > 0
    engine = doc["runs"][0]["phases_s"]
    assert engine["cut"] > 0 and engine["assemble"] > 0, engine
    assert doc["runs"][1]["phases_s"] is None  # dask's own methods have no engine phases
    out = capsys.readouterr().out
    assert "2d-rows-to-cols" in out and "wall s" in out
    assert "rechunk_p2p per phase" in out and "floor/wall" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


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
