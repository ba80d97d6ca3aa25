"""The memory store that fills outputs as pieces arrive: placement, duplicates, missing and
wrong pieces, concurrent writers, what it holds, and closing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rechunk_p2p.cutting.regular import cut_regular_blocking
from rechunk_p2p.errors import RechunkRunError, RechunkTypeError
from rechunk_p2p.planning.partials import Partial
from rechunk_p2p.store.assembling import AssemblingMemoryStore
from rechunk_p2p.transport.wire import pack_blocks


def _partial(shape: tuple[int, ...], old: tuple[int, ...], new: tuple[int, ...]) -> Partial:
    from dask.array.core import normalize_chunks

    n = len(shape)
    return Partial(
        (0,) * n, (0,) * n, (0,) * n, normalize_chunks(old, shape), normalize_chunks(new, shape)
    )


def _store(partial: Partial, dtype: str = "f8") -> AssemblingMemoryStore:
    return AssemblingMemoryStore(np.dtype(dtype), "test", partial)


def _pieces(partial: Partial, data: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """Every piece of ``data`` (chunked as ``partial``'s inputs), as views of it."""
    out = []
    offsets = [np.cumsum((0, *c)) for c in partial.old_chunks]
    for flat in range(partial.n_inputs):
        index = partial.input_index(flat)
        box = tuple(slice(o[i], o[i + 1]) for o, i in zip(offsets, index))
        chunk = data[box]
        out += [(o, flat, chunk[where]) for o, where in partial.pieces_of_input(flat)]
    return out


def _expected(partial: Partial, data: np.ndarray, flat: int) -> np.ndarray:
    offsets = [np.cumsum((0, *c)) for c in partial.new_chunks]
    index = np.unravel_index(flat, partial.new_grid)
    return data[tuple(slice(o[i], o[i + 1]) for o, i in zip(offsets, index))]


@pytest.mark.parametrize(
    ("shape", "old", "new", "dtype"),
    [
        ((16, 32, 32), (1, 32, 32), (16, 8, 8), "f4"),  # maps to time series
        ((30, 30), (7, 30), (30, 4), "f8"),  # irregular edges
        ((12, 10, 6), (5, 3, 6), (4, 10, 2), "i2"),  # strided regions
        ((8, 8), (3, 8), (8, 3), "M8[ns]"),
        ((6, 4), (2, 4), (6, 1), [("a", "i4"), ("b", "f8")]),
    ],
)
def test_every_output_is_assembled_from_pieces_in_any_order(shape, old, new, dtype) -> None:
    partial = _partial(shape, old, new)
    rng = np.random.default_rng(0)
    data = np.zeros(shape, dtype=dtype)
    data.view(np.uint8)[...] = rng.integers(0, 255, data.view(np.uint8).shape, dtype=np.uint8)
    pieces = _pieces(partial, data)
    rng.shuffle(pieces)  # type: ignore[arg-type]
    store = _store(partial, data.dtype)
    half = len(pieces) // 2
    assert store.write_blocking(pieces[:half]) == sum(a.nbytes for _, _, a in pieces[:half])
    store.write_blocking(pieces[half:])
    for flat in range(partial.n_outputs):
        out, missing = store.take_output_blocking(flat)
        assert missing == []
        assert out.flags.c_contiguous and out.flags.writeable
        assert out.dtype == data.dtype and out.tobytes() == _expected(partial, data, flat).tobytes()
    stats = store.statistics()
    assert stats.bytes_written == stats.bytes_read == data.nbytes and stats.bytes_buffered == 0
    assert stats.outputs == 0 and stats.pieces == len(pieces)
    store.close_blocking()


def test_packed_batches_free_their_payload_once_stored() -> None:
    partial = _partial((4, 64, 64), (1, 64, 64), (4, 16, 16))
    data = np.arange(4 * 64 * 64, dtype="f4").reshape(4, 64, 64)
    store = _store(partial, "f4")
    payloads = []
    for flat in range(partial.n_inputs):
        indices, slices = partial.input_cuts(flat)
        blocks = cut_regular_blocking(data[flat : flat + 1], slices)
        packed = pack_blocks(partial.flat_outputs(indices), flat, blocks, np.dtype("f4"))
        store.write_packed_blocking([packed])
        payloads.append(packed.payload)
    # nothing of the store refers to a payload: each could be freed (or reused) now
    for p in payloads:
        p[...] = 0
    for flat in range(partial.n_outputs):
        out, missing = store.take_output_blocking(flat)
        assert missing == [] and np.array_equal(out, _expected(partial, data, flat))
    store.close_blocking()


def test_duplicates_missing_and_held_bytes() -> None:
    partial = _partial((4, 6), (1, 6), (4, 3))
    data = np.arange(24, dtype="f8").reshape(4, 6)
    pieces = _pieces(partial, data)
    store = _store(partial)
    first = [s for s in pieces if s[1] != 2]  # input 2 never comes
    store.write_blocking(first)
    assert store.write_blocking(first[:3]) == 0  # delivered again: dropped
    stats = store.statistics()
    assert stats.duplicates == 3 and stats.outputs == 2
    assert stats.max_bytes_in_memory == data.nbytes  # both outputs allocated whole
    out, missing = store.take_output_blocking(0)
    assert missing == [2] and np.array_equal(out[[0, 1, 3]], data[[0, 1, 3], :3])
    store.write_blocking([s for s in pieces if s[:2] == (0, 2)])  # too late: a new output 0
    assert store.take_output_blocking(0)[1] == [0, 1, 3]
    store.close_blocking()
    assert _store(partial).take_output_blocking(1) == (None, [0, 1, 2, 3])  # nothing came


def test_wrong_pieces_are_refused_and_may_come_again() -> None:
    partial = _partial((4, 6), (2, 6), (4, 3))
    store = _store(partial)
    good = np.ones((2, 3))
    with pytest.raises(RechunkRunError, match="shape"):
        store.write_blocking([(0, 0, good), (0, 1, np.ones((1, 3)))])
    with pytest.raises(RechunkRunError, match="no piece"):
        store.write_blocking([(0, 7, good)])
    with pytest.raises(RechunkTypeError):
        store.write_blocking([(0, 1, good.astype("f4"))])
    # a batch is checked whole before anything is stored: the refused pieces were not
    # taken, and can be delivered right
    assert store.statistics().pieces == 0
    assert store.write_blocking([(0, 0, good), (0, 1, 2 * good)]) == 2 * good.nbytes
    out, missing = store.take_output_blocking(0)
    assert missing == [] and out[:2].sum() == 6 and out[2:].sum() == 12
    with pytest.raises(RechunkTypeError, match="object"):
        AssemblingMemoryStore(np.dtype(object), "x", partial)
    store.close_blocking()


def test_take_waits_for_copies_in_progress_and_close_wakes_it(monkeypatch) -> None:
    import rechunk_p2p.store.placing as placing

    partial = _partial((2, 4), (1, 4), (2, 4))
    store = _store(partial)
    started, release = threading.Event(), threading.Event()
    real = placing.copy_into_blocking

    def slow_copy(region, piece):
        started.set()
        release.wait(10)
        real(region, piece)

    monkeypatch.setattr(placing, "copy_into_blocking", slow_copy)
    writer = threading.Thread(target=store.write_blocking, args=([(0, 0, np.ones((1, 4)))],))
    writer.start()
    assert started.wait(10)
    monkeypatch.setattr(placing, "copy_into_blocking", real)
    store.write_blocking([(0, 1, np.full((1, 4), 2.0))])
    taken: list = []
    reader = threading.Thread(target=lambda: taken.append(store.take_output_blocking(0)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # the first copy is still running
    release.set()
    writer.join(10)
    reader.join(10)
    ((out, missing),) = taken
    assert missing == [] and out.tolist() == [[1.0] * 4, [2.0] * 4]
    store.close_blocking()
    with pytest.raises(RechunkRunError, match="closed"):
        store.take_output_blocking(0)
    with pytest.raises(RechunkRunError, match="closed"):
        store.write_blocking([(0, 0, np.ones((1, 4)))])


def test_many_threads_fill_outputs_together() -> None:
    partial = _partial((64, 16, 16), (1, 16, 16), (64, 4, 4))
    data = np.random.default_rng(1).random((64, 16, 16))
    pieces = _pieces(partial, data)
    store = _store(partial)
    threads = [
        threading.Thread(target=store.write_blocking, args=(pieces[i::8],)) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for flat in range(partial.n_outputs):
        out, missing = store.take_output_blocking(flat)
        assert missing == [] and np.array_equal(out, _expected(partial, data, flat))
    assert store.statistics().duplicates == 0
    store.close_blocking()


def test_new_outputs_have_their_pages_touched_outside_the_gil() -> None:
    import mmap

    from rechunk_p2p.store.base import touch_pages_blocking

    big = np.empty(64 * mmap.PAGESIZE // 8)
    big.view(np.uint8)[...] = 0xAB
    touch_pages_blocking(big)
    first_bytes = big.view(np.uint8)[:: mmap.PAGESIZE]
    assert len(first_bytes) == 64 and not first_bytes.any()  # one byte of every page
    assert (big.view(np.uint8) != 0).sum() == big.nbytes - 64
    small = np.full(4, 7.0)
    touch_pages_blocking(small)  # a few pages: not worth a pass
    assert (small == 7.0).all()


@pytest.mark.parametrize(
    ("shape", "old", "new", "dtype"),
    [
        ((16, 32, 32), (1, 32, 32), (16, 8, 8), "f4"),  # maps to time series
        ((30, 30), (7, 30), (30, 4), "f8"),  # irregular edges: several block shapes
        ((12, 10, 6), (5, 3, 6), (4, 10, 2), "i2"),  # strided places
        ((8, 8), (3, 8), (8, 3), ">f8"),  # the store converts the byte order
        ((64, 512), (1, 512), (64, 4), "f8"),  # thin rows to column strips: slabs
        ((6, 4096), (1, 4096), (6, 512), "f8"),  # 4 KiB pieces: outputs of their own
    ],
)
def test_blocks_of_one_input_are_placed_as_single_pieces_are(shape, old, new, dtype) -> None:
    partial = _partial(shape, old, new)
    rng = np.random.default_rng(1)
    data = rng.integers(0, 1000, shape).astype(dtype)
    by_input: dict[tuple[int, tuple[int, ...]], list[tuple[int, np.ndarray]]] = {}
    for output, input_, array in _pieces(partial, data):
        by_input.setdefault((input_, array.shape), []).append((output, array))
    batches = list(by_input.items())
    rng.shuffle(batches)  # type: ignore[arg-type]
    store = _store(partial, np.dtype(dtype).newbyteorder("="))
    for (input_, _), pieces in batches:
        outputs = np.array([o for o, _ in pieces])
        blocks = np.stack([a for _, a in pieces])
        assert store.write_blocks_blocking(outputs, input_, blocks) == blocks.nbytes
        assert store.write_blocks_blocking(outputs, input_, blocks) == 0  # again: dropped
    for flat in range(partial.n_outputs):
        out, missing = store.take_output_blocking(flat)
        assert missing == []
        np.testing.assert_array_equal(out, _expected(partial, data, flat))
    stats = store.statistics()
    assert stats.bytes_written == data.nbytes and stats.duplicates == stats.pieces
    store.close_blocking()


@pytest.mark.parametrize("outputs", [6, 64])  # placed by a loop; by numpy
def test_batches_name_their_outputs_in_any_order_or_as_a_range(outputs) -> None:
    # input 0's batch allocates the slab in output order; the other inputs' batches list the
    # same outputs permuted (the first and last in place, the others swapped in pairs), as
    # a range, or reversed: each piece must land in its own output, whatever its slots' order
    partial = _partial((3, 4 * outputs), (1, 4 * outputs), (3, 4))
    data = np.arange(3 * 4 * outputs, dtype="f8").reshape(3, 4 * outputs)
    store = _store(partial)
    order = np.arange(outputs)
    swapped = np.concatenate(([0], order[1:-1].reshape(-1, 2)[:, ::-1].reshape(-1), [outputs - 1]))
    for input_, outs in ((0, order), (1, swapped), (2, order[::-1])):
        blocks = data[input_].reshape(outputs, 1, 4)[outs]
        named = range(outputs) if input_ == 1 and outputs > 16 else outs
        if input_ == 1 and outputs > 16:
            blocks = data[input_].reshape(outputs, 1, 4)
        assert store.write_blocks_blocking(named, input_, blocks) == blocks.nbytes
    for flat in range(partial.n_outputs):
        out, missing = store.take_output_blocking(flat)
        assert missing == []
        np.testing.assert_array_equal(out, _expected(partial, data, flat))


def test_small_pieces_fill_outputs_of_one_slab_large_ones_outputs_of_their_own() -> None:
    thin = _partial((8, 64), (1, 64), (8, 4))  # 32-byte pieces: one slab for 16 outputs
    thick = _partial((2, 32768), (1, 32768), (2, 16384))  # 128 KiB pieces
    for partial, shared in ((thin, True), (thick, False)):
        data = np.arange(int(np.prod(partial.output_shape(0))) * partial.n_outputs, dtype="f8")
        data = data.reshape([sum(c) for c in partial.old_chunks])
        store = _store(partial)
        store.write_blocking(_pieces(partial, data))
        outs = [store.take_output_blocking(flat)[0] for flat in range(partial.n_outputs)]
        for flat, out in enumerate(outs):
            assert out.flags.c_contiguous and out.flags.writeable
            np.testing.assert_array_equal(out, _expected(partial, data, flat))
        bases = {id(np.asarray(out).base) for out in outs}
        assert (len(bases) == 1) is shared
        store.close_blocking()


def test_blocks_that_do_not_fit_their_places_are_refused_by_name() -> None:
    partial = _partial((4, 8), (1, 8), (4, 2))
    store = _store(partial)
    blocks = np.zeros((4, 1, 2))
    with pytest.raises(RechunkRunError, match="got 3 outputs and blocks of shape"):
        store.write_blocks_blocking([0, 1, 2], 0, blocks)
    with pytest.raises(RechunkTypeError, match="holds dtype float64; got a piece of dtype int8"):
        store.write_blocks_blocking([0, 1, 2, 3], 0, blocks.astype("i1"))
    with pytest.raises(RechunkRunError, match=r"shape \(1, 3\) for output 0 from input 0"):
        store.write_blocks_blocking([0], 0, np.zeros((1, 1, 3)))
    with pytest.raises(RechunkRunError, match="input 9, which has no piece of that output"):
        store.write_blocks_blocking([0], 9, np.zeros((1, 1, 2)))
    # the refused pieces were not stored and may come again
    assert store.write_blocks_blocking([0, 1, 2, 3], 0, blocks + 1) == blocks.nbytes
    out, missing = store.take_output_blocking(0)
    assert missing == [1, 2, 3] and (out[0] == 1).all()
    store.close_blocking()


def test_a_batch_of_blocks_delivered_again_is_dropped_as_duplicates() -> None:
    partial = _partial((4, 6), (1, 6), (4, 3))
    data = np.arange(24, dtype="f8").reshape(4, 6)
    store = _store(partial)
    for input_ in range(4):
        blocks = cut_regular_blocking(
            data[input_ : input_ + 1], [[slice(0, 1)], [slice(0, 3), slice(3, 6)]]
        )
        assert store.write_blocks_blocking([0, 1], input_, blocks) == blocks.nbytes
        assert store.write_blocks_blocking(np.array([1, 0]), input_, blocks) == 0  # again
    assert store.statistics().duplicates == 8
    for output in (0, 1):
        out, missing = store.take_output_blocking(output)
        assert missing == [] and np.array_equal(out, data[:, 3 * output : 3 * output + 3])
    store.close_blocking()


def test_the_ledger_takes_pairs_and_keys_alike() -> None:
    from rechunk_p2p.store.ledger import PieceLedger, pair_keys

    ledger = PieceLedger()
    assert ledger.admit_keys(pair_keys([1, 2], [2, 1])) is None  # all new
    assert ledger.admit_keys(pair_keys([2, 1, 3], [1, 2, 1])) == [False, False, True]
    assert ledger.admit_keys(pair_keys([4, 4], [0, 0])) == [True, False]  # repeated in a batch
    ledger.forget_keys(pair_keys([1], 2))
    ledger.forget_keys(pair_keys([3], 1))
    assert ledger.admit(1, 2) and ledger.admit_keys(pair_keys([3], 1)) is None
    assert not ledger.admit(2, 1) and ledger.duplicates == 4
    # far outputs do not wrap onto near ones; indices past the keys' range are refused
    assert ledger.admit_keys(pair_keys([2**31 - 1], 0)) is None
    assert ledger.admit(2**31 - 1, 0) is False
    with pytest.raises(RechunkRunError, match="out of range"):
        pair_keys([2**31], 0)
    with pytest.raises(RechunkRunError, match="out of range"):
        pair_keys([0], 2**32)
    with pytest.raises(RechunkRunError, match="out of range"):
        ledger.admit(0, 2**32)


def test_outputs_of_other_shapes_get_slabs_of_their_own() -> None:
    """A row cut for outputs of widths 4, 5 and 5: the pieces of one shape are placed
    together, and each output holds exactly its own columns."""
    partial = _partial((2, 14), (1, 14), (2, (4, 5, 5)))
    store = _store(partial)
    data = np.arange(28, dtype="f8").reshape(2, 14)
    for flat in range(partial.n_inputs):
        store.write_blocking(s for s in _pieces(partial, data) if s[1] == flat)
    for output in range(3):
        out, missing = store.take_output_blocking(output)
        assert missing == [] and out.flags.c_contiguous
        np.testing.assert_array_equal(out, _expected(partial, data, output))
    store.close_blocking()


def test_slabs_hold_at_most_their_bytes(monkeypatch) -> None:
    import rechunk_p2p.store.assembling as assembling

    monkeypatch.setattr(assembling, "SLAB_BYTES", 4 * 8 * 8 * 3)  # three outputs of 8 x 4
    partial = _partial((8, 64), (1, 64), (8, 4))
    data = np.arange(8 * 64, dtype="f8").reshape(8, 64)
    store = _store(partial)
    store.write_blocking(_pieces(partial, data))
    outs = [store.take_output_blocking(flat)[0] for flat in range(16)]
    for flat, out in enumerate(outs):
        np.testing.assert_array_equal(out, _expected(partial, data, flat))
    assert len({id(out.base) for out in outs}) == 6  # 16 outputs, three a slab
    store.close_blocking()


def test_an_output_forgotten_after_it_was_taken_is_assembled_again_whole() -> None:
    partial = _partial((4, 6), (1, 6), (4, 3))
    data = np.arange(24, dtype="f8").reshape(4, 6)
    pieces = _pieces(partial, data)
    store = _store(partial)
    store.write_blocking(pieces)
    out, missing = store.take_output_blocking(1)
    assert missing == [] and np.array_equal(out, _expected(partial, data, 1))
    again = [s for s in pieces if s[0] == 1]
    assert store.write_blocking(again) == 0  # its pairs are held: dropped
    store.forget_outputs_blocking([1])
    assert store.write_blocking(again[:2]) == 2 * 3 * 8
    assert store.take_output_blocking(1)[1] == [2, 3]  # a new output 1, missing what did not come
    store.forget_outputs_blocking([1])
    store.write_blocking(again)
    out, missing = store.take_output_blocking(1)
    assert missing == [] and np.array_equal(out, _expected(partial, data, 1))
    store.close_blocking()
