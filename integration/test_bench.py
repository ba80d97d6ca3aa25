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
    out = capsys.readouterr().out
    assert "2d-rows-to-cols" in out and "wall s" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 10_000
