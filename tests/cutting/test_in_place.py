"""Pieces sent as blocks of their input chunk: the plan, the wire layout, the receiver's view."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.cutting import in_place
from rechunk_p2p.cutting.in_place import plan_blocks
from rechunk_p2p.cutting.regular import cut_regular_blocking
from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.planning.partials import Partial
from rechunk_p2p.store.assembling import AssemblingMemoryStore
from rechunk_p2p.transport.wire import (
    Packed,
    in_order,
    pack_box,
    payload_views,
    split_packed_blocking,
    unpack_blocking,
    unpack_blocks,
)


def _received(packed: Packed) -> Packed:
    """``packed`` as its receiver gets it: the header, and the payload's bytes in one array."""
    wire = b"".join(bytes(v) for v in payload_views(packed.payload))
    return Packed.from_message(packed.header(), np.frombuffer(wire, dtype=np.uint8).copy())


@st.composite
def grids(draw):
    """A C-contiguous chunk, a regular grid of pieces over it, and some consecutive
    positions in the grid (a worker's outputs of the chunk)."""
    ndim = draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    lengths = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    dtype = np.dtype(draw(st.sampled_from(["u1", "i4", "f8"])))
    shape = tuple(c * n for c, n in zip(counts, lengths))
    data = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    total = int(np.prod(counts))
    first = draw(st.integers(0, total - 1))
    last = draw(st.integers(first, total - 1))
    return data, counts, lengths, np.arange(first, last + 1)


@settings(max_examples=300, deadline=None)
@given(grids())
def test_blocks_carry_exactly_the_cut_pieces_on_both_ends_of_the_wire(case):
    data, counts, lengths, chosen = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(in_place, "MIN_ROW_BYTES", 0)
        blocks = plan_blocks(data.shape, data.itemsize, counts, lengths, chosen)
    slices = [[slice(i * n, (i + 1) * n) for i in range(c)] for c, n in zip(counts, lengths)]
    cut = cut_regular_blocking(data, slices)  # the reference: every piece, in grid order
    assert blocks is not None
    assert np.concatenate([p for p, _, _ in blocks]).tolist() == chosen.tolist()
    outputs = np.arange(100, 100 + cut.shape[0])
    for positions, box_slices, along in blocks:
        packed = pack_box(outputs[positions], 7, data[box_slices], along, tuple(lengths))
        assert np.shares_memory(packed.payload, data)  # sent from the chunk itself
        assert packed.nbytes == len(positions) * cut[0].nbytes
        for end in (packed, _received(packed)):
            input_, pieces = unpack_blocks(end, data.dtype)
            assert input_ == 7
            np.testing.assert_array_equal(pieces, cut[positions])
            assert [o for o, _, _ in unpack_blocking(end, data.dtype)] == list(end.outputs)
            ordered = in_order(end, data.dtype)
            assert ordered.along == 0 and ordered.payload.flags.c_contiguous
            np.testing.assert_array_equal(
                ordered.payload.view(data.dtype).reshape(cut[positions].shape), cut[positions]
            )


def test_blocks_split_where_a_grid_row_ends_and_where_positions_jump():
    # a chunk cut 4 x 4 (rows of 256 float64): positions 2..9 and 12 span three grid rows
    blocks = plan_blocks((8, 1024), 8, [4, 4], [2, 256], np.array([2, 3, 4, 5, 6, 7, 12]))
    got = [(p.tolist(), s, a) for p, s, a in blocks]
    assert got == [
        ([2, 3], (slice(0, 2), slice(512, 1024)), 1),
        ([4, 5, 6, 7], (slice(2, 4), slice(0, 1024)), 1),
        ([12], (slice(6, 8), slice(0, 256)), 0),
    ]


def test_short_rows_are_cut_instead():
    # 64 float32 a row (256 bytes) is below the bound; 4 pieces side by side (1 KiB) are not
    assert plan_blocks((32, 512), 4, [1, 8], [32, 64], np.array([0])) is None
    assert plan_blocks((32, 512), 4, [1, 8], [32, 64], np.arange(4)) is not None
    # stacked along the first axis, a block of whole rows is one contiguous run: any size
    assert plan_blocks((64, 16), 1, [8, 1], [8, 16], np.arange(3)) is not None
    assert plan_blocks((64, 16), 1, [8, 2], [8, 8], np.arange(1)) is None


def test_payload_views_are_the_bytes_in_c_order_without_a_copy():
    data = np.arange(2 * 6 * 10, dtype="i2").reshape(2, 6, 10)
    for view in (data, data[:, 1:4], data[:, :, 2:7], data[1:, 2:5, 3:9]):
        got = payload_views(view.view(np.uint8))
        assert b"".join(bytes(v) for v in got) == np.ascontiguousarray(view).tobytes()
        assert all(np.shares_memory(np.asarray(v), data) for v in got)
    assert len(payload_views(data[:, 1:4])) == 2  # one run per leading index


def test_a_stray_axis_in_a_header_is_refused():
    header = {"first": 0, "count": 2, "input": 1, "shape": [2, 3], "along": 2}
    with pytest.raises(RechunkRunError, match="axis 2"):
        Packed.from_message(header, np.zeros(48, dtype=np.uint8))


def test_a_split_batch_of_blocks_keeps_each_piece():
    data = np.arange(4 * 12, dtype="f8").reshape(4, 12)
    packed = _received(pack_box(np.arange(3), 0, data[:, 3:12], 1, (4, 3)))
    kept, rest = split_packed_blocking(packed, np.array([True, False, True]), data.dtype)
    assert list(kept.outputs) == [0, 2] and list(rest.outputs) == [1]
    np.testing.assert_array_equal(unpack_blocks(kept, data.dtype)[1][1], data[:, 9:12])
    np.testing.assert_array_equal(unpack_blocks(rest, data.dtype)[1][0], data[:, 6:9])


def test_the_assembling_store_copies_pieces_out_of_a_chunks_block():
    from dask.array.core import normalize_chunks

    # one 4 x 8 chunk into two 4 x 4 outputs, sent as the chunk itself
    old, new = normalize_chunks((4, 8), (4, 8)), normalize_chunks((4, 4), (4, 8))
    store = AssemblingMemoryStore(
        np.dtype("f8"), "in-place", Partial((0, 0), (0, 0), (0, 0), old, new)
    )
    data = np.arange(32, dtype="f8").reshape(4, 8)
    assert store.write_packed_blocking([pack_box(np.arange(2), 0, data, 1, (4, 4))]) == 256
    for output, cols in ((0, slice(0, 4)), (1, slice(4, 8))):
        out, missing = store.take_output_blocking(output)
        assert not missing
        np.testing.assert_array_equal(out, data[:, cols])
        assert not np.shares_memory(out, data)  # copied: the chunk may go
    store.close_blocking()
