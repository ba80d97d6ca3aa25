"""Reading an output's pieces straight into the output array (both stores)."""

from __future__ import annotations

import numpy as np
import pytest

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.store import make_store
from rechunk_p2p.store.base import place_blocking


@pytest.mark.parametrize("kind", ["disk", "memory"])
@pytest.mark.parametrize("dtype", ["f8", ">i4", "U3", [("a", "i2"), ("b", "f4")], "O"], ids=str)
def test_read_into_places_every_piece_and_discards(tmp_path, kind, dtype):
    dtype = np.dtype(dtype)
    full = np.arange(6 * 8).reshape(6, 8).astype(dtype)
    # contiguous slabs along axis 0 and strided column blocks
    placement = {
        0: (slice(0, 2), slice(None)),
        1: (slice(2, 4), slice(0, 3)),
        2: (slice(2, 4), slice(3, 8)),
        3: (slice(4, 6), slice(None)),
    }
    store = make_store(kind, dtype=dtype, directory=tmp_path, name="run-1")
    try:
        store.write_blocking(
            [(7, i, np.ascontiguousarray(full[sl])) for i, sl in placement.items()]
        )
        out = np.empty(full.shape, dtype=dtype)
        placed = store.read_into_blocking(7, out, placement)
        assert sorted(placed) == [0, 1, 2, 3]
        np.testing.assert_array_equal(out, full)
        assert store.read_into_blocking(7, out, placement) == []
        assert store.statistics().bytes_buffered == 0
    finally:
        store.close_blocking()
    with pytest.raises(RechunkRunError):
        store.read_into_blocking(7, out, placement)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_read_into_reports_missing_pieces(tmp_path, kind):
    store = make_store(kind, dtype=np.dtype("f4"), directory=tmp_path, name="r")
    try:
        store.write_blocking([(0, 1, np.ones(3, "f4"))])
        out = np.zeros(6, "f4")
        placed = store.read_into_blocking(0, out, {0: (slice(0, 3),), 1: (slice(3, 6),)})
        assert placed == [1]
        np.testing.assert_array_equal(out, [0, 0, 0, 1, 1, 1])
    finally:
        store.close_blocking()


@pytest.mark.parametrize(
    ("shape", "where", "dtype"),
    [
        ((8, 4, 4), (slice(2, 3), slice(0, 4), slice(0, 4)), "f4"),  # one contiguous run
        ((8, 8), (slice(0, 4), slice(4, 8)), "f8"),  # strided region
        ((), (), "i8"),  # 0-d
        ((0, 3), (slice(0, 0), slice(0, 3)), "f8"),  # empty
        ((4, 4), (slice(0, 2), slice(None)), "O"),  # object: never a raw copy
        ((4, 4), (slice(1, 3), slice(None)), [("a", "i2"), ("b", "f4")]),
    ],
    ids=["run", "strided", "0-d", "empty", "object", "structured"],
)
def test_place_blocking_copies_into_the_region_only(shape, where, dtype):
    dtype = np.dtype(dtype)
    out = np.zeros(shape, dtype=dtype)
    before = out.copy()
    region_shape = out[(*where, Ellipsis)].shape
    piece = (np.arange(int(np.prod(region_shape))) + 1).astype(dtype).reshape(region_shape)
    place_blocking(out, where, piece)
    np.testing.assert_array_equal(out[(*where, Ellipsis)], piece)
    rest = np.ones(shape, bool)
    rest[(*where, Ellipsis)] = False
    np.testing.assert_array_equal(out[rest], before[rest])


def test_place_blocking_takes_non_contiguous_and_large_pieces():
    out = np.zeros((4, 2**16), "f8")  # rows of 512 KiB: above the small-copy size
    piece = np.arange(2 * 2**17, dtype="f8").reshape(2, 2**17)[:, ::2]  # strided source
    place_blocking(out, (slice(1, 3), slice(None)), piece)
    np.testing.assert_array_equal(out[1:3], piece)
    assert not out[0].any() and not out[3].any()
