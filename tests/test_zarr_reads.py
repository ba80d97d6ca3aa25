"""A joined read of a zarr array goes through zarrs' codec pipeline where zarrs can read it,
with zarr-python's values; anything else reads as dask's ``getter`` does."""

from __future__ import annotations

import sys

import dask.array as da
import numpy as np
import pytest
import zarr
from dask.array.core import getter

from rechunk_p2p import zarr_reads
from rechunk_p2p.zarr_reads import read_box_blocking, reader_for

zarrs = pytest.importorskip("zarrs")

BOXES = [
    (slice(0, 30), slice(0, 4), slice(0, 6)),
    (slice(7, 19), slice(1, 3), slice(2, 5)),  # not on chunk edges
    (slice(29, 30), slice(0, 4), slice(0, 6)),
]


def _pipeline_module(array) -> str:
    return type(array.async_array.codec_pipeline).__module__.split(".")[0]


def _filled(path, **kwargs):
    z = zarr.create_array(path, shape=(30, 4, 6), chunks=(1, 4, 3), **kwargs)
    values = np.arange(z.size).reshape(z.shape).astype(z.dtype)
    values[3:5] = 0  # (chunks equal to the fill value are not written: read as fill)
    z[:] = values
    return z, values


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": "f4"},
        {"dtype": "i2", "fill_value": -7},
        {"dtype": "f8", "zarr_format": 2},
        {"dtype": "u1", "compressors": None},
    ],
    ids=["v3-f4", "v3-i2-fill", "v2-f8", "v3-uncompressed"],
)
def test_a_local_store_is_read_through_zarrs_with_zarrs_values(tmp_path, kwargs):
    z, values = _filled(tmp_path / "a.zarr", **kwargs)
    reader = reader_for(z)
    assert reader is not z and _pipeline_module(reader) == "zarrs"
    assert _pipeline_module(z) == "zarr"  # (the user's array object is left as it was)
    for box in BOXES:
        got = read_box_blocking(z, box)
        assert got.dtype == values.dtype
        np.testing.assert_array_equal(got, values[box])
        np.testing.assert_array_equal(got, getter(z, box))


def test_a_path_opened_by_dask_is_read_through_zarrs(tmp_path):
    _, values = _filled(tmp_path / "a.zarr", dtype="f4")
    x = da.from_zarr(str(tmp_path / "a.zarr"))  # (an fsspec store over the directory)
    (source,) = (getattr(v, "value", v) for k, v in x.dask.items() if isinstance(k, str))
    assert type(source.store).__name__ == "FsspecStore"
    assert _pipeline_module(reader_for(source)) == "zarrs"
    np.testing.assert_array_equal(read_box_blocking(source, BOXES[1]), values[BOXES[1]])


def test_one_reader_per_array_object_while_it_lives(tmp_path):
    z, _ = _filled(tmp_path / "a.zarr", dtype="f4")
    assert reader_for(z) is reader_for(z)
    other = zarr.open_array(tmp_path / "a.zarr", mode="r")
    assert reader_for(other) is not reader_for(z)
    before = len(zarr_reads._READERS)
    del other
    reader_for(zarr.open_array(tmp_path / "a.zarr", mode="r"))  # (a miss drops dead entries)
    assert len(zarr_reads._READERS) <= before


def test_what_zarrs_cannot_read_is_read_as_it_is(tmp_path, monkeypatch):
    held = np.arange(24.0).reshape(4, 6)
    assert reader_for(held) is held
    np.testing.assert_array_equal(read_box_blocking(held, (slice(1, 3),)), held[1:3])
    memory = zarr.create_array(zarr.storage.MemoryStore(), shape=(8, 4), chunks=(2, 4), dtype="f4")
    memory[:] = np.arange(32.0).reshape(8, 4)
    np.testing.assert_array_equal(
        read_box_blocking(memory, (slice(1, 7), slice(0, 4))), memory[1:7]
    )
    z, values = _filled(tmp_path / "a.zarr", dtype="f4")
    monkeypatch.setitem(sys.modules, "zarrs", None)  # zarrs not installed
    monkeypatch.setattr(zarr_reads, "_READERS", {})
    assert reader_for(z) is z
    np.testing.assert_array_equal(read_box_blocking(z, BOXES[0]), values)


def test_the_zarr_config_is_left_as_it_was(tmp_path):
    z, _ = _filled(tmp_path / "a.zarr", dtype="f4")
    before = zarr.config.get("codec_pipeline.path")
    reader_for(z)
    assert zarr.config.get("codec_pipeline.path") == before
    assert _pipeline_module(zarr.open_array(tmp_path / "a.zarr", mode="r")) == "zarr"
