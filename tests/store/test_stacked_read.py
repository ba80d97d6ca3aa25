"""Outputs whose pieces lie one after another in memory are read by one move per piece (one
read per run of pieces that also lie one after another on disk), by both stores."""

from __future__ import annotations

import itertools
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.planning import Partial
from rechunk_p2p.store import DiskPieceStore, MemoryPieceStore
from rechunk_p2p.transport.wire import pack_blocking

KINDS = ["memory", "disk", "disk-packed", "disk-buffered", "disk-direct", "disk-direct-buffered"]


def partial_of(old: tuple[tuple[int, ...], ...], new: tuple[tuple[int, ...], ...]) -> Partial:
    zeros = (0,) * len(old)
    return Partial(zeros, zeros, zeros, old, new)


def new_store(kind: str, dtype: np.dtype, name: str, directory: str):
    if kind == "memory":
        return MemoryPieceStore(dtype, name)
    buffer_bytes = 64 if kind.endswith("-buffered") else 0
    return DiskPieceStore(dtype, directory, name, buffer_bytes, direct_io="direct" in kind)


def write_all(store, partial: Partial, data: np.ndarray, packed: bool = False) -> None:
    """Every piece of ``data`` (the partial's whole array), as the engine cuts them: one
    write per input, of its pieces or (``packed``) of one batch holding them, as received."""
    starts = [np.cumsum((0, *c)) for c in partial.old_chunks]
    for flat, index in enumerate(itertools.product(*(range(n) for n in partial.old_grid))):
        chunk = data[tuple(slice(s[i], s[i + 1]) for s, i in zip(starts, index))]
        pieces = [(out, flat, chunk[where]) for out, where in partial.pieces_of_input(flat)]
        if packed:
            store.write_packed_blocking([pack_blocking(pieces, data.dtype)])
        else:
            store.write_blocking(pieces)


def chunks_summing_to(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    cuts = st.lists(st.integers(1, n - 1), max_size=3) if n > 1 else st.just([])
    return cuts.map(lambda c: tuple(np.diff([0, *sorted(set(c)), n]).tolist()))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=3).flatmap(
        lambda shape: st.tuples(
            st.tuples(*(chunks_summing_to(n) for n in shape)),
            st.tuples(*(chunks_summing_to(n) for n in shape)),
            st.sampled_from(["f8", "i2", ">u4", "U3"]),
        )
    )
)
@pytest.mark.parametrize("kind", KINDS)
def test_stacked_outputs_match_the_placed_ones(kind, case):
    old, new, dtype = case
    partial = partial_of(old, new)
    shape = tuple(sum(c) for c in old)
    data = np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)
    with tempfile.TemporaryDirectory() as directory:
        stacked = new_store(kind, data.dtype, "s", directory)
        placed = new_store(kind, data.dtype, "p", directory)
        write_all(stacked, partial, data, packed=kind != "disk")
        write_all(placed, partial, data, packed=kind != "disk")
        compare_reads(partial, data, stacked, placed)
        stacked.close_blocking()
        placed.close_blocking()


def compare_reads(partial: Partial, data: np.ndarray, stacked, placed) -> None:
    for flat in range(partial.n_outputs):
        want = np.empty(partial.output_shape(flat), data.dtype)
        placement = dict(partial.pieces_of_output(flat))
        assert sorted(placed.read_into_blocking(flat, want, placement)) == sorted(placement)
        order = partial.stacked_inputs(flat)
        if order is None:
            continue
        assert sorted(order) == sorted(placement)
        got = np.empty_like(want)
        assert stacked.read_stacked_blocking(flat, got, order) == order
        np.testing.assert_array_equal(got, want)


def test_maps_to_time_series_and_rows_to_columns_are_stacked_blocks_to_tiles_are_not():
    assert partial_of(((1,) * 4, (8,)), ((4,), (4, 4))).stacked_inputs(1) == [0, 1, 2, 3]
    assert partial_of(((2, 2), (4,)), ((4,), (2, 2))).stacked_inputs(0) == [0, 1]
    assert partial_of(((2, 2), (2, 2)), ((4,), (4,))).stacked_inputs(0) is None


@pytest.mark.parametrize("kind", ["memory", "disk", "disk-buffered"])
def test_a_missing_piece_stops_the_read_and_a_wrong_size_raises(kind, tmp_path):
    store = new_store(kind, np.dtype("f8"), "m", str(tmp_path))
    store.write_blocking([(0, 0, np.ones((1, 2))), (0, 2, np.ones((1, 2)))])
    out = np.empty((3, 2))
    assert store.read_stacked_blocking(0, out, [0, 1, 2]) == [0]  # the caller names input 1
    store.write_blocking([(1, 0, np.ones((1, 2))), (1, 1, np.ones((1, 3)))])
    with pytest.raises(RechunkRunError, match="hold 40 of its 48 bytes"):
        store.read_stacked_blocking(1, np.empty((3, 2)), [0, 1])
    store.close_blocking()
    with pytest.raises(RechunkRunError, match="closed"):
        store.read_stacked_blocking(1, out, [0])


@pytest.mark.parametrize(("buffer_bytes", "reads"), [(0, 64), (2**20, 1), (64 * 64 * 8 // 4, 8)])
def test_a_write_buffer_lays_each_output_out_in_one_piece_per_flush(
    tmp_path, monkeypatch, buffer_bytes, reads
):
    """64 row chunks -> 8 column chunks of 8 float64: written as they arrive, each output is
    64 reads; gathered in a buffer holding everything, one; in one holding a quarter, eight
    (half the buffer is written at a time)."""
    import os

    partial = partial_of(((1,) * 64, (64,)), ((64,), (8,) * 8))
    data = np.arange(64 * 64, dtype="f8").reshape(64, 64)
    store = DiskPieceStore(data.dtype, str(tmp_path), "b", buffer_bytes=buffer_bytes)
    write_all(store, partial, data, packed=True)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(a[2]) or real(*a))
    for flat in range(8):
        calls.clear()
        out = np.empty((64, 8))
        assert store.read_stacked_blocking(flat, out, partial.stacked_inputs(flat)) == list(
            range(64)
        )
        np.testing.assert_array_equal(out, data[:, flat * 8 : flat * 8 + 8])
        assert len(calls) == reads
    store.close_blocking()


@pytest.mark.parametrize("kind", KINDS[:3])
@pytest.mark.parametrize("dtype", ["f4", "M8[s]", "c16"])
def test_stacked_pieces_of_every_size_and_layout(kind, dtype, tmp_path):
    """Small contiguous pieces (moved with the GIL held), one past ``SMALL_COPY_BYTES``
    (copied by numpy), a strided one and an empty one, of float, complex and datetime
    dtypes."""
    from rechunk_p2p.store.base import SMALL_COPY_BYTES

    dtype = np.dtype(dtype)
    width = 64
    big_rows = SMALL_COPY_BYTES // (width * dtype.itemsize) + 1
    rows = [1, 3, big_rows, 2, 0, 1]
    values = np.arange(sum(rows) * width).reshape(-1, width)
    data = values.astype("M8[s]") if dtype.kind == "M" else values.astype(dtype)
    starts = np.cumsum([0, *rows])
    pieces = []
    for i, (lo, hi) in enumerate(itertools.pairwise(starts.tolist())):
        piece = data[lo:hi]
        if i == 3:  # strided: every other column of a twice-as-wide array
            wide = np.empty((hi - lo, 2 * width), dtype=dtype)
            wide[:, ::2] = piece
            piece = wide[:, ::2]
            assert not piece.flags.c_contiguous
        pieces.append((0, i, piece))
    store = new_store(kind, dtype, "sizes", str(tmp_path))
    if kind == "disk-packed":
        store.write_packed_blocking([pack_blocking(pieces, dtype)])
    else:
        store.write_blocking(pieces)
    out = np.empty_like(data)
    assert store.read_stacked_blocking(0, out, list(range(len(rows)))) == list(range(len(rows)))
    np.testing.assert_array_equal(out, data)
    store.close_blocking()
