"""One check of requested chunk sizes for every entry point: zero, negative other than -1,
non-integer sizes and unknown dimensions give the same one-line ``RechunkInputError``
before anything is read or written (no cluster needed: the check comes first)."""

from __future__ import annotations

import dask.array as da
import pytest
import xarray as xr

import rechunk_p2p
from rechunk_p2p import cli
from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.integrations.zarr import plan_zarr, rechunk_zarr
from rechunk_p2p.integrations.zarr_input import check_zarr_rechunk
from tests.integrations.stores import SHAPE, make_climate_group

_AXIS = "(axis 0|dimension 'time')"  # xarray names the dimension (and the variable)
BAD = {
    "zero": (0, rf"Chunk size 0 along {_AXIS} \(length 24\) of .* is not a positive size"),
    "negative": (-3, rf"Chunk size -3 along {_AXIS} \(length 24\) of .* is not a positive"),
    "far negative": (-1000, rf"Chunk size -1000 along {_AXIS}"),
    "fraction": (2.5, rf"Chunk size 2.5 along {_AXIS}"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "src.zarr"
    make_climate_group(path, 3)
    return path


@pytest.mark.parametrize("case", list(BAD))
def test_every_entry_point_refuses_the_same_way(case, source, tmp_path, capsys):
    size, message = BAD[case]
    x = da.ones(SHAPE, chunks=(1, SHAPE[1], SHAPE[2]))
    ds = xr.Dataset({"t": (("time", "lat", "lon"), x)})
    target = tmp_path / "out.zarr"
    calls = {
        "rechunk": lambda: rechunk_p2p.rechunk(x, {0: size}),
        "plan": lambda: rechunk_p2p.plan(x, {0: size}),
        "xarray": lambda: rechunk_p2p.rechunk(ds, {"time": size}),
        "rechunk_zarr": lambda: rechunk_zarr(source, target, {"time": size}, progress=False),
        "lazy": lambda: rechunk_zarr(source, target, {"time": size}, compute=False),
        "plan_zarr": lambda: plan_zarr(source, {"time": size}),
        "check": lambda: check_zarr_rechunk(source, target, {"time": size}),
    }
    for name, call in calls.items():
        with pytest.raises(RechunkInputError, match=message) as info:
            call()
        assert "\n" not in str(info.value), name
    assert not target.exists()
    capsys.readouterr()
    assert cli.main([str(source), str(target), "--chunks", f"time={size}"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{size!r}" in err, err
    assert not target.exists()


def test_an_unknown_dimension_is_named_by_every_entry_point(source, tmp_path):
    ds = xr.Dataset({"t": (("time", "lat", "lon"), da.ones(SHAPE))})
    with pytest.raises(RechunkInputError, match="'height'"):
        rechunk_p2p.rechunk(ds, {"height": 2})
    for call in (
        lambda: rechunk_zarr(source, tmp_path / "o.zarr", {"height": 2}, progress=False),
        lambda: plan_zarr(source, {"height": 2}),
    ):
        with pytest.raises(RechunkInputError, match=r"unknown dimension name.*'height'"):
            call()
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize(
    "chunks", [(5, -1, -1), {0: -1}, {"time": None}, "auto", ((4, 4, 4, 12), -1, -1)]
)
def test_valid_sizes_pass(chunks):
    from rechunk_p2p.chunk_sizes import check_chunk_sizes

    per_axis = tuple(chunks.get(a) for a in range(3)) if isinstance(chunks, dict) else chunks
    if isinstance(per_axis, str):
        per_axis = (per_axis,) * 3
    check_chunk_sizes(per_axis, (24, 10, 10), "x")


def test_explicit_lengths_with_a_negative_or_fraction_are_refused():
    from rechunk_p2p.chunk_sizes import check_chunk_sizes

    for lengths in [(4, -4), (2.5, 5.5)]:
        with pytest.raises(RechunkInputError, match=r"Chunk lengths .* along axis 0"):
            check_chunk_sizes((lengths,), (8,), "x")


@pytest.mark.parametrize("coordinates", [False, True])
def test_one_value_for_a_group_keeps_coordinates_unless_asked(source, coordinates):
    """``--chunks 4``: every array of the group, but dimension coordinates (``time``,
    ``lat``, ``lon``) keep their layout unless ``coordinates`` (``--include-coords``)."""
    from rechunk_p2p.integrations.zarr_input import (
        is_dimension_coordinate,
        open_source,
        resolve_layouts,
    )

    root = open_source(source)
    layouts = {lay.name: lay for lay in resolve_layouts(root, 4, coordinates=coordinates)}
    coords = [n for n, lay in layouts.items() if is_dimension_coordinate(n, lay.source)]
    assert sorted(coords) == ["lat", "lon", "time"]
    for name in coords:
        assert layouts[name].rechunked is coordinates, name
    assert layouts["temperature"].rechunked and layouts["temperature"].chunks == (4, 4, 4)
