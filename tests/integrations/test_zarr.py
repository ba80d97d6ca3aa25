"""rechunk_zarr end to end on real zarr stores (formats 2 and 3) and a real LocalCluster."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import zarr

from rechunk_p2p.errors import RechunkInputError, RechunkTypeError
from rechunk_p2p.integrations.zarr import (
    check_zarr_rechunk,
    plan_zarr,
    rechunk_zarr,
    source_arrays,
)
from tests.conftest import assert_clean_sync

from .stores import (
    SHAPE,
    arrays_of,
    assert_same_values,
    make_climate_group,
)

T, Y, X = SHAPE


def dims_of(arr: zarr.Array):
    if arr.metadata.zarr_format == 3:
        return arr.metadata.dimension_names
    names = arr.attrs.get("_ARRAY_DIMENSIONS")
    return tuple(names) if names is not None else None


def same_fill(a, b) -> bool:
    return (a is None and b is None) or a == b or (np.isnan(a) and np.isnan(b))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_group_rechunk_keeps_everything(p2p_client, tmp_path, zarr_format):
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, zarr_format)

    report = rechunk_zarr(src, tgt, {"time": -1, "lat": 5}, progress=False)

    expected_chunks = {
        "temperature": (T, 5, X),
        "orography": (5, X),
        "time": (T,),  # dimension coordinates keep their own layout (as xarray's do)
        "lat": (Y,),
        "lon": (X,),  # no chunks asked for lon: copied in its own layout
        "version": (),
        "meta/station_ids": (3,),
    }
    source, target = arrays_of(src), arrays_of(tgt)
    assert sorted(target) == sorted(source)
    for name, a in source.items():
        b = target[name]
        assert_same_values(a, b)
        assert b.metadata.zarr_format == zarr_format
        assert tuple(b.chunks) == expected_chunks[name], name
        assert dict(b.attrs) == dict(a.attrs), name
        assert dims_of(b) == dims_of(a), name
        assert same_fill(a.fill_value, b.fill_value), name
        assert b.compressors == a.compressors, name
        assert b.filters == a.filters, name
    src_group, tgt_group = zarr.open_group(src, mode="r"), zarr.open_group(tgt, mode="r")
    assert dict(tgt_group.attrs) == dict(src_group.attrs)
    assert dict(tgt_group["meta"].attrs) == {"source": "synthetic"}
    assert tgt_group.metadata.consolidated_metadata is not None

    assert {a.name for a in report.arrays if a.rechunked} == {"temperature", "orography"}
    assert report.nbytes == sum(a.nbytes for a in source.values())
    assert report.statistics["runs"] >= 1  # the P2P engine moved the data
    assert "throughput" in str(report)
    assert_clean_sync(p2p_client)


def test_v2_to_v3_sharded_target(p2p_client, tmp_path):
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 2, consolidated=False)

    rechunk_zarr(
        src,
        tgt,
        {"time": 4, "lat": 5},
        shards={"time": -1, "lat": 10},
        zarr_format=3,
        progress=False,
    )

    temp = zarr.open_array(tgt / "temperature", mode="r")
    assert temp.metadata.zarr_format == 3
    assert tuple(temp.chunks) == (4, 5, X)
    assert tuple(temp.shards) == (T, 10, X)
    assert temp.metadata.dimension_names == ("time", "lat", "lon")
    assert "_ARRAY_DIMENSIONS" not in temp.attrs
    assert dict(temp.attrs) == {"units": "K"}
    for name, a in arrays_of(src).items():
        assert_same_values(a, arrays_of(tgt)[name])
    assert zarr.open_group(tgt, mode="r").metadata.consolidated_metadata is None
    assert_clean_sync(p2p_client)


def test_v3_to_v2_writes_array_dimensions(p2p_client, tmp_path):
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 3, consolidated=False)
    sharded = zarr.open_group(src, mode="a").create_array(
        "sharded", shape=(12,), chunks=(2,), shards=(6,), dtype="int32", dimension_names=("x",)
    )
    sharded[:] = np.arange(12, dtype="int32")

    rechunk_zarr(src, tgt, {"lon": 6}, zarr_format=2, progress=False)

    temp = zarr.open_array(tgt / "temperature", mode="r")
    assert temp.metadata.zarr_format == 2
    assert tuple(temp.chunks) == (1, Y, 6)
    assert temp.attrs["_ARRAY_DIMENSIONS"] == ["time", "lat", "lon"]
    assert_same_values(zarr.open_array(src / "temperature", mode="r"), temp)
    copied = zarr.open_array(tgt / "sharded", mode="r")  # format 2 has no shards
    assert (copied.metadata.zarr_format, tuple(copied.chunks)) == (2, (2,))
    assert_same_values(sharded, copied)


def test_store_tasks_write_whole_shards(tmp_path):
    """Each store task writes exactly one whole shard: no two tasks share one."""
    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)
    job = check_zarr_rechunk(
        src, tmp_path / "tgt.zarr", {"time": 4, "lat": 5}, shards={"time": 8, "lat": 10}
    )
    stored = source_arrays(job.layouts)

    for lay, arr in zip(job.layouts, stored, strict=True):
        unit = lay.shards or lay.chunks
        assert all(
            all(c == u for c in axis[:-1]) and axis[-1] <= u
            for axis, u in zip(arr.chunks, unit, strict=True)
        ), (lay.name, arr.chunks, unit)
        if lay.name == "temperature":
            assert unit == (8, 10, X)
            assert arr.numblocks == (math.ceil(T / 8), 1, 1)


def test_array_source_with_options(p2p_client, tmp_path):
    src = tmp_path / "a.zarr"
    arr = zarr.create_array(
        src, shape=(20, 30), chunks=(1, 30), dtype="int32", dimension_names=("t", "x")
    )
    arr[:] = np.arange(600, dtype="int32").reshape(20, 30)

    rechunk_zarr(
        str(src),
        tmp_path / "b.zarr",
        {"t": -1, 1: 7},
        array_options={"compressors": None},
        progress=False,
    )
    out = zarr.open_array(tmp_path / "b.zarr", mode="r")
    assert tuple(out.chunks) == (20, 7)
    assert out.compressors == ()
    assert out.metadata.dimension_names == ("t", "x")
    np.testing.assert_array_equal(out[:], arr[:])

    rechunk_zarr(arr, tmp_path / "c.zarr", (5, -1), progress=False)  # a zarr Array as source
    assert tuple(zarr.open_array(tmp_path / "c.zarr", mode="r").chunks) == (5, 30)

    # a file:// URL as source, a LocalStore as target
    rechunk_zarr(f"file://{src}", zarr.storage.LocalStore(tmp_path / "d.zarr"), 10, progress=False)
    out = zarr.open_array(tmp_path / "d.zarr", mode="r")
    assert tuple(out.chunks) == (10, 10)
    np.testing.assert_array_equal(out[:], arr[:])


def test_overwrite_replaces_target(p2p_client, tmp_path):
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 3)
    rechunk_zarr(src, tgt, {"time": 12}, progress=False)

    with pytest.raises(RechunkInputError, match="already exists"):
        rechunk_zarr(src, tgt, {"time": 6}, progress=False)
    assert tuple(zarr.open_array(tgt / "temperature", mode="r").chunks) == (12, Y, X)

    rechunk_zarr(src, tgt, {"time": 6}, overwrite=True, progress=False)
    assert tuple(zarr.open_array(tgt / "temperature", mode="r").chunks) == (6, Y, X)
    assert_same_values(
        zarr.open_array(src / "temperature", mode="r"),
        zarr.open_array(tgt / "temperature", mode="r"),
    )


@pytest.mark.parametrize("storage", ["disk", "memory"])
def test_storage_setting_reaches_the_engine(p2p_client, tmp_path, storage):
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 3)

    report = rechunk_zarr(src, tgt, {"time": -1, "lat": 5}, storage=storage, progress=False)

    if storage == "disk":
        assert report.bytes_spilled > 0
    else:
        assert report.bytes_spilled == 0
    assert report.statistics["bytes_sent"] > 0
    assert_clean_sync(p2p_client)


def test_failure_removes_created_target(p2p_client, tmp_path):
    """A corrupt source chunk fails the rechunk on a worker: the target is removed."""
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 3)
    chunk = src / "temperature" / "c" / "5" / "0" / "0"
    assert chunk.exists()
    chunk.write_bytes(b"this is not zstd")

    with pytest.raises(Exception) as info:
        rechunk_zarr(src, tgt, {"time": -1, "lat": 5}, progress=False)
    assert not isinstance(info.value, RechunkInputError)
    assert not tgt.exists(), [str(p) for p in tgt.rglob("*")]
    assert_clean_sync(p2p_client)


def test_target_of_the_wrong_type_is_refused(tmp_path):
    make_climate_group(tmp_path / "src.zarr", 3)
    with pytest.raises(RechunkTypeError, match="path, URL or zarr store"):
        rechunk_zarr(tmp_path / "src.zarr", 42, {"time": -1}, progress=False)


def test_in_memory_target_is_refused(tmp_path):
    """Workers unpickle their own copy of a MemoryStore: their writes would be lost."""
    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)
    with pytest.raises(RechunkInputError, match="in-memory store"):
        rechunk_zarr(src, zarr.storage.MemoryStore(), {"time": -1}, progress=False)


def test_plan_zarr_describes_every_array(tmp_path):
    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)

    plans = plan_zarr(src, {"time": -1, "lat": 5}, n_workers=3)

    layout, plan = plans["temperature"]
    assert layout.chunks == (T, 5, X)
    assert plan.old_chunks[0] == (1,) * T and plan.new_chunks[0] == (T,)
    assert plan.n_output_chunks == 2
    assert plans["lon"][1] is None and plans["meta/station_ids"][1] is None
    assert not (tmp_path / "tgt.zarr").exists()


# --- bad input: a clear error before any data moves ------------------------------------


def _bad_calls(tmp_path):
    src = tmp_path / "src.zarr"
    arr = src / "temperature"
    return {
        "missing source": ((tmp_path / "nope.zarr", {"time": -1}), {}, "does not exist"),
        "not zarr": ((tmp_path / "plain", {"time": -1}), {}, "not a zarr"),
        "unknown dimension": ((src, {"time": -1, "level": 3}), {}, "unknown dimension.*level"),
        "axis numbers in group": ((src, {0: -1}), {}, "axis numbers"),
        "tuple for group": ((src, (1, 2, 3)), {}, "dict keyed by dimension"),
        "too many dims": ((arr, (1, 2, 3, 4)), {}, "give 4 dimension.*has 3"),
        "axis out of range": ((arr, {3: 2}), {}, "out of range"),
        "unknown dim of array": ((arr, {"level": 2}), {}, "unknown dimension name 'level'"),
        "irregular": ((arr, ((10, 14), -1, -1)), {}, "irregular"),
        "shards not multiple": ((src, {"time": 4}), {"shards": {"time": 6}}, "multiple"),
        "shards in v2": (
            (src, {"time": 4}),
            {"shards": {"time": 8}, "zarr_format": 2},
            "no shards",
        ),
        "bad storage": ((src, {"time": 4}), {"storage": "tape"}, "storage"),
        "bad option": ((src, {"time": 4}), {"array_options": {"shape": (1,)}}, "array_options"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing source",
        "not zarr",
        "unknown dimension",
        "axis numbers in group",
        "tuple for group",
        "too many dims",
        "axis out of range",
        "unknown dim of array",
        "irregular",
        "shards not multiple",
        "shards in v2",
        "bad storage",
        "bad option",
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, case):
    make_climate_group(tmp_path / "src.zarr", 3)
    (tmp_path / "plain").mkdir()
    (source, chunks), kwargs, message = _bad_calls(tmp_path)[case]
    tgt = tmp_path / "tgt.zarr"

    with pytest.raises(RechunkInputError, match=message):
        rechunk_zarr(source, tgt, chunks, progress=False, **kwargs)
    assert not tgt.exists(), [str(p) for p in tgt.rglob("*")]


def test_existing_target_is_left_alone(tmp_path):
    make_climate_group(tmp_path / "src.zarr", 3)
    tgt = tmp_path / "tgt"
    tgt.mkdir()
    (tgt / "keep.txt").write_text("precious")

    with pytest.raises(RechunkInputError, match="already exists"):
        rechunk_zarr(tmp_path / "src.zarr", tgt, {"time": -1}, progress=False)
    with pytest.raises(RechunkInputError, match="not a zarr store; refusing"):
        rechunk_zarr(tmp_path / "src.zarr", tgt, {"time": -1}, overwrite=True, progress=False)
    assert os.listdir(tgt) == ["keep.txt"]


def test_target_inside_source_is_refused(tmp_path):
    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)
    files_before = sorted(str(p) for p in tmp_path.rglob("*"))
    for target in (src, src / "rechunked", tmp_path):
        with pytest.raises(RechunkInputError, match="overlaps the source"):
            rechunk_zarr(src, target, {"time": -1}, overwrite=True, progress=False)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == files_before


def test_coordinates_follow_dimension_chunks_only_when_asked(p2p_client, tmp_path):
    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)
    chunks = {"time": 4, "lat": 5}
    report = rechunk_zarr(src, tmp_path / "a.zarr", chunks, coordinates=True, progress=False)
    assert {a.name for a in report.arrays if a.rechunked} >= {"time", "lat"}
    assert zarr.open_array(tmp_path / "a.zarr" / "lat").chunks == (5,)
    default = rechunk_zarr(src, tmp_path / "b.zarr", chunks, progress=False)
    assert not {"time", "lat"} & {a.name for a in default.arrays if a.rechunked}
    assert zarr.open_array(tmp_path / "b.zarr" / "lat").chunks == (Y,)


def test_progress_stays_out_of_logs_and_pipes(p2p_client, tmp_path, capfd):
    """Not on a terminal (pytest captures stdout and stderr), the progress bar writes nothing
    (it used to write 1,200-1,400 carriage-return updates into logs)."""
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 3)
    rechunk_zarr(src, tgt, {"time": -1, "lat": 5}, progress=True)
    out, err = capfd.readouterr()
    assert "\r" not in out and "\r" not in err
    assert "[#" not in out and "[#" not in err


def test_report_renders_as_html_tables(p2p_client, tmp_path):
    src, tgt = tmp_path / "src.zarr", tmp_path / "tgt.zarr"
    make_climate_group(src, 3)
    report = rechunk_zarr(src, tgt, {"time": -1, "lat": 5}, progress=False)
    html = report._repr_html_()
    assert html.count("<table") == 2
    assert all(f"<td>{a.name}</td>" in html for a in report.arrays)
    assert "<th>array</th>" in html and "throughput" in html


def test_bare_format2_array_with_a_numcodecs_compressor(p2p_client, tmp_path):
    """A bare zarr format-2 array (no group) keeps its format and its numcodecs compressor
    (the target used to be created as format 3, which refused the compressor)."""
    import numcodecs

    src = zarr.create_array(
        tmp_path / "a.zarr",
        shape=(40, 30),
        chunks=(1, 30),
        dtype="f4",
        zarr_format=2,
        compressors=numcodecs.Zstd(level=3),
    )
    src[:] = np.arange(1200, dtype="f4").reshape(40, 30)
    rechunk_zarr(tmp_path / "a.zarr", tmp_path / "b.zarr", (40, 5), progress=False)
    out = zarr.open_array(tmp_path / "b.zarr")
    assert out.metadata.zarr_format == 2
    assert out.chunks == (40, 5)
    assert isinstance(out.compressors[0], numcodecs.Zstd)
    np.testing.assert_array_equal(out[:], src[:])


def test_lazy_rechunk_like_rechunker(p2p_client, tmp_path):
    """compute=False: a plan to inspect, nothing written until execute(); max_mem decides
    where pieces wait (a tiny budget: on disk; a large one: in memory)."""
    from rechunk_p2p.integrations.zarr import ZarrRechunk

    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)
    chunks = {"time": -1, "lat": 5}
    lazy = rechunk_zarr(src, tmp_path / "a.zarr", chunks, compute=False, max_mem="1KiB")
    assert isinstance(lazy, ZarrRechunk)
    assert lazy.plan["temperature"].new_chunks[0] == (T,)
    assert lazy.plan["lon"] is None  # copied as it is
    assert lazy.plan["temperature"].send_buffer_bytes == 512  # half the budget, to send
    assert "at most 512 B queued for sending" in repr(lazy.plan["temperature"])
    assert "call .execute()" in repr(lazy) and "<table" in lazy._repr_html_()
    assert not (tmp_path / "a.zarr").exists()
    report = lazy.execute()
    assert report.bytes_spilled > 0  # 1 KiB per worker: the pieces waited on disk
    assert_same_values(arrays_of(src)["temperature"], arrays_of(tmp_path / "a.zarr")["temperature"])
    with pytest.raises(RechunkInputError, match="executed already"):
        lazy.execute()
    roomy = rechunk_zarr(src, tmp_path / "b.zarr", chunks, max_mem="1GiB", progress=False)
    assert roomy.bytes_spilled == 0
    with pytest.raises(RechunkInputError, match="max_mem must be a positive"):
        rechunk_zarr(src, tmp_path / "c.zarr", {"time": -1, "lat": 5}, max_mem=0)
    assert not (tmp_path / "c.zarr").exists()
    assert_clean_sync(p2p_client)


def test_report_has_the_event_loop_lag(p2p_client, tmp_path):
    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)
    report = rechunk_zarr(src, tmp_path / "t.zarr", {"time": -1, "lat": 5}, progress=False)
    p99, worst, workers, scheduler = report.loop_lag
    assert 0 <= p99 <= max(worst, scheduler) and workers == 2
    assert str(report).splitlines()[-1].startswith("  event-loop lag: p99 ")
    assert " ms on 2 workers, " in str(report).splitlines()[-1]


def test_lazy_rechunk_as_a_dask_graph(p2p_client, tmp_path):
    """to_dask(): one delayed object that writes the target when computed, returns a count
    (nothing of the data), and consolidates the metadata as the source had it."""
    import dask

    src = tmp_path / "src.zarr"
    make_climate_group(src, 3)  # consolidated
    lazy = rechunk_zarr(src, tmp_path / "g.zarr", {"time": -1, "lat": 5}, compute=False)
    parts = lazy.to_dask()
    assert len(parts) == 1
    graph = dict(parts[0].__dask_graph__())
    assert any(isinstance(k, tuple) and k[0].startswith("rechunk-p2p-out-") for k in graph)
    (result,) = dask.compute(*parts)
    units = [(a.shape, a.shards or a.chunks) for a in arrays_of(tmp_path / "g.zarr").values()]
    n_chunks = sum(math.prod(-(-n // u) for n, u in zip(*unit)) for unit in units)
    assert result == {"chunks": n_chunks}
    assert_same_values(arrays_of(src)["temperature"], arrays_of(tmp_path / "g.zarr")["temperature"])
    group = zarr.open_group(tmp_path / "g.zarr", mode="r")
    assert group.metadata.consolidated_metadata is not None
    assert not (tmp_path / "g.zarr" / ".rechunk-p2p").exists()
    with pytest.raises(RechunkInputError, match="executed already"):
        lazy.execute()
