"""Round trips through both piece stores: every dtype, 0-d, zero-size, non-contiguous input."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rechunk_p2p.store import DiskPieceStore, MemoryPieceStore, PieceStore, make_store
from rechunk_p2p.transport.wire import Packed, pack_box, payload_views

from .helpers import assert_same

FIXED_WIDTH = [
    "i1",
    "i2",
    "i4",
    "i8",
    "u1",
    "u2",
    "u4",
    "u8",
    ">i4",
    "f2",
    "f4",
    "f8",
    ">f8",
    "g",
    "c8",
    "c16",
    "?",
    "M8[ns]",
    "M8[D]",
    "m8[s]",
    "S5",
    "U7",
    "V3",
    np.dtype([("a", "i4"), ("b", "f8"), ("c", "U2")]),
    np.dtype([("a", "u1"), ("b", "f8")], align=True),  # with padding
    np.dtype([("x", "f4", (2, 3)), ("t", "M8[ms]")]),  # sub-array field
]
OBJECT = ["O", np.dtype([("a", "O"), ("b", "i4")])]
ALL_DTYPES = FIXED_WIDTH + OBJECT


def sample(dtype: object, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random content: random bytes for fixed-width dtypes, mixed Python objects otherwise."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    if not dtype.hasobject:
        raw = rng.integers(0, 256, size * dtype.itemsize, dtype=np.uint8).tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    objects = [None, 1, "two", [3.0, {"four": 4}], (5,), b"six", 7.5]
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    for k in range(size):
        obj = objects[int(rng.integers(len(objects)))]
        if dtype.names:
            flat[k] = (obj, k)
        else:
            flat[k] = obj
    return out


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_every_dtype(make, dtype):
    store = make(dtype)
    arrays = {
        (o, i): sample(dtype, (3, o + 1, 2), seed=10 * o + i) for o in range(3) for i in range(4)
    }
    written = store.write_blocking((o, i, a) for (o, i), a in arrays.items())
    stats = store.statistics()
    assert written == stats.bytes_written == stats.bytes_buffered > 0
    assert (stats.pieces, stats.outputs, stats.duplicates) == (12, 3, 0)
    for o in range(3):
        got = store.read_blocking(o)
        assert [i for i, _ in got] == [0, 1, 2, 3]
        for i, array in got:
            assert_same(arrays[o, i], array)
    assert store.statistics().bytes_buffered == 0


@pytest.mark.parametrize("dtype", ["f8", "U3", "M8[s]", "O", FIXED_WIDTH[-1]], ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (4, 0, 3), (0, 0)], ids=str)
def test_zero_d_and_zero_size(make, dtype, shape):
    store = make(dtype)
    array = sample(dtype, shape, seed=3)
    other = sample(dtype, (2,), seed=4)
    store.write_blocking([(5, 0, array), (5, 1, other), (6, 0, array)])
    assert store.statistics().pieces == 3
    (i0, a0), (i1, a1) = store.read_blocking(5)
    assert (i0, i1) == (0, 1)
    assert_same(array, a0)
    assert_same(other, a1)
    [(_, a2)] = store.read_blocking(6)
    assert_same(array, a2)


@pytest.mark.parametrize("dtype", ["i8", "U4", np.dtype([("a", "i2"), ("b", "f4")]), "O"], ids=str)
def test_non_contiguous_inputs(make, dtype):
    base = sample(dtype, (6, 8, 5), seed=1)
    views = [
        base[::2],
        base[:, ::-3],
        base.transpose(2, 0, 1),
        base[1:4, 2, ::2],
        np.asfortranarray(base),
    ]
    store = make(dtype)
    store.write_blocking((0, i, v) for i, v in enumerate(views))
    got = store.read_blocking(0)
    assert len(got) == len(views)
    for (_, array), view in zip(got, views, strict=True):
        assert_same(view, array)
        assert not np.shares_memory(array, base)


def test_read_only_input_is_returned_writeable(make):
    array = np.arange(6.0).reshape(2, 3)
    array.flags.writeable = False
    store = make("f8")
    store.write_blocking([(0, 0, array)])
    [(_, got)] = store.read_blocking(0)
    assert_same(array, got)
    got[0, 0] = 42.0  # writeable, and the caller's read-only array is untouched
    assert array[0, 0] == 0.0


def test_memory_store_keeps_the_given_arrays():
    store = make_store("memory", dtype=np.dtype("i4"), directory=None, name="m")
    array = np.arange(10, dtype="i4")
    assert store.write_blocking([(0, 0, array)]) == 40
    [(_, got)] = store.read_blocking(0)
    assert got is array
    store.close_blocking()


def test_disk_store_reads_into_fresh_owned_buffers(tmp_path):
    store = make_store("disk", dtype=np.dtype("f4"), directory=tmp_path, name="d")
    arrays = [np.full((100, 3), i, dtype="f4") for i in range(5)]
    store.write_blocking((0, i, a) for i, a in enumerate(arrays))
    got = store.read_blocking(0)
    for (_, array), expected in zip(got, arrays, strict=True):
        assert array.base is None  # the buffer read into *is* the array: no extra copy
        assert not np.shares_memory(array, expected)
        assert_same(expected, array)
    store.close_blocking()


def test_large_pieces_round_trip(tmp_path):
    store = make_store("disk", dtype=np.dtype("u8"), directory=tmp_path, name="big")
    big = np.random.default_rng(0).integers(0, 2**63, size=(2048, 1024), dtype="u8")  # 16 MiB
    small = np.arange(3, dtype="u8")
    assert store.write_blocking([(1, 0, big), (1, 1, small)]) == big.nbytes + small.nbytes
    [(_, a), (_, b)] = store.read_blocking(1)
    np.testing.assert_array_equal(a, big)
    np.testing.assert_array_equal(b, small)
    store.close_blocking()


def test_make_store_returns_the_right_classes(tmp_path):
    memory = make_store("memory", dtype=np.dtype("f8"), directory=tmp_path, name="x")
    disk = make_store("disk", dtype=np.dtype("f8"), directory=tmp_path, name="x")
    assert isinstance(memory, MemoryPieceStore)
    assert isinstance(disk, DiskPieceStore)
    assert isinstance(memory, PieceStore)
    assert isinstance(disk, PieceStore)
    assert (memory.statistics().kind, disk.statistics().kind) == ("memory", "disk")
    for store in (memory, disk):
        store.close_blocking()


# -- property-based: random dtypes, shapes and strides ---------------------------------------

DTYPES = (
    hnp.scalar_dtypes()
    | hnp.byte_string_dtypes()
    | hnp.unicode_string_dtypes()
    | hnp.array_dtypes(hnp.scalar_dtypes(), min_size=1, max_size=3)
)


@st.composite
def piece_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(DTYPES)
    array = draw(
        hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    )
    if array.ndim and draw(st.booleans()):  # a strided, possibly reversed, view
        steps = [draw(st.sampled_from([1, 2, -1, -2])) for _ in range(array.ndim)]
        array = array[tuple(slice(None, None, s) for s in steps)]
    return array


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(piece_arrays(), min_size=1, max_size=4), st.sampled_from(["memory", "disk"]))
def test_random_arrays_round_trip(arrays, kind):
    dtype = arrays[0].dtype
    arrays = [a for a in arrays if a.dtype == dtype]
    with tempfile.TemporaryDirectory() as directory:
        store = make_store(kind, dtype=dtype, directory=directory, name="hyp")
        store.write_blocking((7, 10 - i, a) for i, a in enumerate(arrays))
        got = store.read_blocking(7)
        assert [i for i, _ in got] == sorted(10 - i for i in range(len(arrays)))
        for i, array in got:
            assert_same(arrays[10 - i], array)
        assert store.statistics().bytes_read == sum(a.nbytes for a in arrays)
        store.close_blocking()
        assert not os.listdir(directory)


@pytest.mark.parametrize("dtype", ["f4", ">i8", "U3", "O"])
def test_packed_batches_round_trip_and_drop_pairs_stored_before(make, dtype):
    """Batches as they come off the wire: pieces of several shapes in one payload, a batch
    half made of pairs already stored (a re-run transfer), and a batch wholly repeated."""
    from rechunk_p2p.transport.wire import pack_blocking

    store = make(dtype)
    dt = np.dtype(dtype)
    pieces = {
        o: np.arange(o * 10, o * 10 + (o + 1) * 2).astype(dt).reshape(o + 1, 2) for o in range(4)
    }
    first = pack_blocking([(o, 7, pieces[o]) for o in (0, 1, 2)], dt)
    again = pack_blocking([(o, 7, pieces[o]) for o in (1, 3)], dt)  # (1, 7) stored before
    written = [store.write_packed_blocking([first]), store.write_packed_blocking([again, first])]
    if not dt.hasobject:  # (pickled sizes otherwise)
        assert written == [sum(pieces[o].nbytes for o in (0, 1, 2)), pieces[3].nbytes]
    stats = store.statistics()
    assert (stats.pieces, stats.duplicates, stats.outputs) == (4, 4, 4)
    for o in range(4):
        [(input_, got)] = store.read_blocking(o)
        assert input_ == 7
        assert_same(pieces[o], got)
    assert store.statistics().outputs == 0


def test_a_received_batch_of_blocks_is_stored_piece_by_piece(make):
    """A batch sent as a block of its input chunk (pieces side by side along an axis, as
    a worker whose store assembles sends it) reaches a peer whose store keeps what it is
    given: every piece reads back whole."""
    chunk = np.arange(6 * 40, dtype="f8").reshape(6, 40)
    sent = pack_box(np.arange(3, 7), 9, chunk[:, 8:40], 1, (6, 8))
    wire = b"".join(bytes(v) for v in payload_views(sent.payload))
    received = Packed.from_message(sent.header(), np.frombuffer(wire, dtype=np.uint8).copy())
    store = make()
    assert store.write_packed_blocking([received]) == 4 * 6 * 8 * 8
    for k, output in enumerate(range(3, 7)):
        ((input_, piece),) = store.read_blocking(output)
        assert input_ == 9
        assert_same(chunk[:, 8 * (k + 1) : 8 * (k + 2)], piece)


def test_an_output_forgotten_after_it_was_read_takes_its_pieces_again(make):
    """An output read (its pieces consumed) and then assembled again here: its pieces sent
    anew are stored as new ones once it is forgotten, and dropped as duplicates before."""
    store = make()
    pieces = {(o, i): np.full((2, 3), 10 * o + i, dtype="f8") for o in (0, 1) for i in (4, 5)}
    store.write_blocking([(o, i, a) for (o, i), a in pieces.items()])
    assert [i for i, _ in store.read_blocking(0)] == [4, 5]
    assert store.write_blocking([(0, 4, pieces[0, 4])]) == 0  # read already: a duplicate
    store.forget_outputs_blocking([0])
    assert store.write_blocking([(0, i, pieces[0, i]) for i in (4, 5)]) == 2 * 48
    assert store.write_blocking([(1, 5, pieces[1, 5])]) == 0  # other outputs are as they were
    for output in (0, 1):
        got = store.read_blocking(output)
        assert [i for i, _ in got] == [4, 5]
        for input_, array in got:
            assert_same(pieces[output, input_], array)
    assert store.statistics().duplicates == 2
