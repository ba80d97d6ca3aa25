"""Packing pieces into one payload and back: every dtype, views, empty and 0-d pieces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rechunk_p2p.cutting.regular import cut_regular_blocking
from rechunk_p2p.errors import RechunkInputError, RechunkRunError
from rechunk_p2p.transport.wire import (
    Packed,
    pack_blocking,
    pack_blocks,
    unpack_blocking,
    unpack_blocks,
)

DTYPES = [
    "f8",
    "f4",
    "i8",
    ">i4",
    "u2",
    "c16",
    "?",
    "M8[ns]",
    "m8[s]",
    "S5",
    "U3",
    [("a", "i4"), ("b", "f8", (2,))],
    "O",
]


def sample(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype.kind == "O":
        flat = np.empty(n, dtype=object)
        flat[:] = [{"i": i, "s": "x" * (i % 3)} for i in range(n)]
        return flat.reshape(shape)
    raw = np.arange(n * dtype.itemsize, dtype="u1") % 251
    return raw.view(dtype).reshape(shape)


def assert_same(pieces, back):
    assert len(pieces) == len(back)
    for (o, i, a), (o2, i2, b) in zip(pieces, back):
        assert (o, i) == (o2, i2)
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_every_dtype(dtype):
    dtype = np.dtype(dtype)
    x = sample(dtype, (6, 7))
    pieces = [
        (0, 1, x[1:4, ::2]),  # a strided view
        (2, 3, x[:, :0]),  # no elements
        (4, 5, x[0, 0:1].reshape(())),  # 0-d
        (6, 7, np.ascontiguousarray(x[::-1])),
    ]
    packed = pack_blocking(pieces, dtype)
    back = unpack_blocking(packed, dtype)
    assert_same(pieces, back)
    if dtype.kind != "O":
        assert packed.nbytes == sum(s[2].size for s in pieces) * dtype.itemsize
        assert all(b.dtype == dtype for _, _, b in back)


def test_unpacked_arrays_view_the_payload_without_copying():
    x = np.arange(100.0).reshape(10, 10)
    packed = pack_blocking([(0, 0, x[:5]), (1, 0, x[5:])], x.dtype)
    back = unpack_blocking(packed, x.dtype)
    assert all(np.shares_memory(b, packed.payload) for _, _, b in back)


def test_message_header_roundtrip():
    x = np.arange(12, dtype="i2").reshape(3, 4)
    packed = pack_blocking([(3, 9, x[:, 1:3])], x.dtype)
    again = Packed.from_message(packed.header(), packed.payload)
    assert again == packed or (again.outputs, again.inputs, again.shapes) == (
        packed.outputs,
        packed.inputs,
        packed.shapes,
    )
    np.testing.assert_array_equal(unpack_blocking(again, x.dtype)[0][2], x[:, 1:3])


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, 4, np.arange(6.0)), (1, 4, np.arange(6.0, 12))],  # regular: one input, one shape
        [(0, 4, np.arange(6.0)), (1, 5, np.arange(6.0))],  # two inputs
        [(0, 4, np.arange(6.0)), (1, 4, np.arange(3.0))],  # two shapes
    ],
)
def test_header_names_a_regular_batch_s_input_and_shape_once(pieces):
    import msgpack

    packed = pack_blocking(pieces, np.dtype("f8"))
    header = packed.header()
    regular = len({i for _, i, _ in pieces}) == 1 and len({a.shape for *_, a in pieces}) == 1
    assert ("input" in header) == regular and ("inputs" in header) != regular
    again = Packed.from_message(msgpack.unpackb(msgpack.packb(header)), packed.payload)
    assert (again.outputs, again.inputs, again.shapes) == (
        packed.outputs,
        packed.inputs,
        packed.shapes,
    )
    for (o, i, a), (o2, i2, a2) in zip(pieces, unpack_blocking(again, np.dtype("f8"))):
        assert (o, i) == (o2, i2)
        np.testing.assert_array_equal(a, a2)


def test_truncated_payload_is_detected():
    x = np.arange(10.0)
    packed = pack_blocking([(0, 0, x)], x.dtype)
    broken = Packed(packed.outputs, packed.inputs, ((11,),), packed.payload)
    with pytest.raises(RechunkRunError, match="Packed payload has 80 bytes, its pieces 88"):
        unpack_blocking(broken, x.dtype)  # a corrupt batch fails the run, not the user's input


DTYPE_CHOICES = [np.dtype("f8"), np.dtype("i1"), np.dtype("c8"), np.dtype("S2")]


@st.composite
def same_dtype_arrays(draw):
    dtype = draw(st.sampled_from(DTYPE_CHOICES))
    shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
    return draw(st.lists(hnp.arrays(dtype=dtype, shape=shapes), min_size=1, max_size=6))


@settings(max_examples=60, deadline=None)
@given(arrays=same_dtype_arrays())
def test_roundtrip_random_shapes(arrays):
    dtype = arrays[0].dtype
    pieces = [(k, 2 * k, a) for k, a in enumerate(arrays)]
    back = unpack_blocking(pack_blocking(pieces, dtype), dtype)
    for (_, _, a), (_, _, b) in zip(pieces, back):
        np.testing.assert_array_equal(a, b)


def test_a_regular_cut_into_a_buffer_is_a_view_of_it_and_equals_a_fresh_cut():
    data = np.arange(6 * 8, dtype=">i4").reshape(6, 8)  # a byte-order change too
    slices = [[slice(0, 3), slice(3, 6)], [slice(0, 4), slice(4, 8)]]
    buffer = np.full(data.nbytes + 16, 255, dtype=np.uint8)
    blocks = cut_regular_blocking(data, slices, np.dtype("<i4"), out=buffer)
    fresh = cut_regular_blocking(data, slices, np.dtype("<i4"))
    assert blocks.dtype == np.dtype("<i4") and blocks.shape == (4, 3, 4)
    np.testing.assert_array_equal(blocks, fresh)
    np.testing.assert_array_equal(blocks[1], data[0:3, 4:8])
    assert np.shares_memory(blocks, buffer)
    assert (buffer[data.nbytes :] == 255).all()  # nothing written past the cut
    with pytest.raises(RechunkInputError, match="at least 192 bytes"):
        cut_regular_blocking(data, slices, out=np.empty(data.nbytes - 1, dtype=np.uint8))


def test_a_batch_of_one_input_and_one_shape_unpacks_as_one_array_and_others_do_not():
    blocks = np.arange(24, dtype="f8").reshape(3, 2, 4)
    packed = pack_blocks(np.array([5, 6, 7]), 2, blocks, np.dtype("f8"))
    input_, unpacked = unpack_blocks(packed, np.dtype("f8"))
    assert input_ == 2 and np.array_equal(unpacked, blocks)
    assert np.shares_memory(unpacked, packed.payload)
    two_inputs = pack_blocking([(0, 1, blocks[0]), (1, 2, blocks[1])], np.dtype("f8"))
    two_shapes = pack_blocking([(0, 1, blocks[0]), (1, 1, blocks[1, :1])], np.dtype("f8"))
    assert unpack_blocks(two_inputs, np.dtype("f8")) is None
    assert unpack_blocks(two_shapes, np.dtype("f8")) is None
    short = Packed(packed.outputs, packed.inputs, packed.shapes, packed.payload[:-8])
    with pytest.raises(RechunkRunError, match="has 184 bytes, its pieces 192"):
        unpack_blocks(short, np.dtype("f8"))
