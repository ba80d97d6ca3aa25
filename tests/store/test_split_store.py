"""The store that fills some outputs in memory and spills the others: every piece goes to
its output's part, batches are split without a copy where they can be, what is spilled is
counted, and closing removes the files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rechunk_p2p.cutting.regular import cut_regular_blocking
from rechunk_p2p.errors import RechunkInputError, RechunkTypeError
from rechunk_p2p.store import SplitStore, make_store
from rechunk_p2p.transport.wire import (
    pack_blocking,
    pack_blocks,
    split_packed_blocking,
)

from .test_assembling_store import _expected, _partial, _pieces

F4 = np.dtype("f4")


def _split(partial, in_memory, directory: Path, buffer_bytes: int = 0) -> SplitStore:
    mask = np.zeros(partial.n_outputs, dtype=bool)
    mask[list(in_memory)] = True
    store = make_store(
        "memory+disk",
        dtype=F4,
        directory=directory,
        name="split-test",
        buffer_bytes=buffer_bytes,
        partial=partial,
        in_memory=mask,
    )
    assert isinstance(store, SplitStore)
    return store


def _take(store: SplitStore, partial, flat: int) -> np.ndarray:
    if store.holds_in_memory(flat):
        out, missing = store.take_output_blocking(flat)
    else:
        out = np.empty(partial.output_shape(flat), dtype=F4)
        got = store.read_into_blocking(flat, out, dict(partial.pieces_of_output(flat)))
        missing = sorted(set(range(partial.n_inputs)) - set(got))
    assert missing == []
    return out


@pytest.mark.parametrize("buffer_bytes", [0, 4096])
@pytest.mark.parametrize("in_memory", [{0, 1, 2}, {1, 5, 14}])  # first outputs, or scattered
def test_batches_are_split_between_memory_and_disk(tmp_path, in_memory, buffer_bytes) -> None:
    partial = _partial((8, 32, 32), (1, 32, 32), (8, 8, 8))  # 16 outputs, maps to series
    data = np.arange(8 * 32 * 32, dtype=F4).reshape(8, 32, 32)
    store = _split(partial, in_memory, tmp_path / "spill", buffer_bytes)
    for flat in range(partial.n_inputs):
        indices, slices = partial.input_cuts(flat)
        blocks = cut_regular_blocking(data[flat : flat + 1], slices)
        packed = pack_blocks(partial.flat_outputs(indices), flat, blocks, F4)
        assert store.write_packed_blocking([packed]) == packed.nbytes
        if not buffer_bytes:  # (a write buffer keeps views until it is written)
            packed.payload[...] = 0  # neither part kept a view of the batch
    output_bytes = 8 * 8 * 8 * F4.itemsize
    stats = store.statistics()
    assert stats.kind == "memory+disk"
    assert stats.bytes_written == data.nbytes
    assert stats.bytes_spilled == (16 - len(in_memory)) * output_bytes
    for flat in range(partial.n_outputs):
        assert np.array_equal(_take(store, partial, flat), _expected(partial, data, flat))
    assert store.statistics().bytes_buffered == 0
    store.close_blocking()
    assert not (tmp_path / "spill").exists()


def test_pieces_one_by_one_go_to_their_part_and_duplicates_are_dropped(tmp_path) -> None:
    partial = _partial((6, 4), (1, 4), (6, 1))
    data = np.arange(24, dtype=F4).reshape(6, 4)
    pieces = _pieces(partial, data)
    store = _split(partial, {3}, tmp_path / "spill")
    assert store.write_blocking(pieces) == data.nbytes
    assert store.write_blocking(pieces[:5]) == 0  # a retried delivery
    stats = store.statistics()
    assert (stats.duplicates, stats.bytes_spilled) == (5, 3 * 6 * F4.itemsize)
    for flat in range(partial.n_outputs):
        assert np.array_equal(_take(store, partial, flat), _expected(partial, data, flat))
    store.close_blocking()


def test_a_bad_piece_stores_nothing_in_either_part(tmp_path) -> None:
    partial = _partial((2, 2), (1, 2), (2, 1))
    store = _split(partial, {0}, tmp_path / "spill")
    bad = [(0, 0, np.zeros(1, F4)), (1, 0, np.zeros(1, "f8"))]
    with pytest.raises(RechunkTypeError, match="holds dtype float32"):
        store.write_blocking(bad)
    stats = store.statistics()
    assert (stats.pieces, stats.bytes_written, stats.outputs) == (0, 0, 0)
    store.close_blocking()


def test_split_views_a_prefix_and_copies_anything_else() -> None:
    pieces = [(o, 7, np.full((2, o + 1), o, dtype=F4)) for o in range(4)]
    packed = pack_blocking(pieces, F4)
    kept, rest = split_packed_blocking(packed, np.array([True, True, False, False]), F4)
    assert kept.outputs == (0, 1) and rest.outputs == (2, 3)
    assert np.shares_memory(kept.payload, packed.payload)
    assert np.shares_memory(rest.payload, packed.payload)
    assert kept.nbytes + rest.nbytes == packed.nbytes
    kept, rest = split_packed_blocking(packed, np.array([False, True, False, True]), F4)
    assert (kept.outputs, kept.inputs, kept.shapes) == ((1, 3), (7, 7), ((2, 2), (2, 4)))
    assert kept.payload.view(F4).tolist() == [1.0] * 4 + [3.0] * 8
    assert rest.payload.view(F4).tolist() == [0.0] * 2 + [2.0] * 6
    assert not np.shares_memory(kept.payload, packed.payload)


def test_memory_plus_disk_needs_what_it_splits_by(tmp_path) -> None:
    with pytest.raises(RechunkInputError, match="'memory\\+disk' needs"):
        make_store("memory+disk", dtype=F4, directory=tmp_path, name="x")


def test_outputs_forgotten_in_either_part_take_their_pieces_again(tmp_path) -> None:
    partial = _partial((4, 6), (1, 6), (4, 3))
    data = np.arange(24, dtype=F4).reshape(4, 6)
    pieces = _pieces(partial, data)
    store = _split(partial, {0}, tmp_path)  # output 0 in memory, output 1 spilled
    store.write_blocking(pieces)
    for flat in (0, 1):
        assert np.array_equal(_take(store, partial, flat), _expected(partial, data, flat))
    assert store.write_blocking(pieces) == 0  # every pair held: dropped
    store.forget_outputs_blocking([0, 1])
    assert store.write_blocking(pieces) == data.nbytes
    for flat in (0, 1):
        assert np.array_equal(_take(store, partial, flat), _expected(partial, data, flat))
    store.close_blocking()


@pytest.mark.parametrize("buffer_bytes", [0, 4096])
def test_a_spill_moves_what_memory_holds_and_every_later_piece_goes_to_disk(
    tmp_path, buffer_bytes
) -> None:
    """Half the pieces come, the outputs in memory move to disk (the worker was paused),
    the other half come: every output is read whole from disk, nothing is duplicated, and
    the memory part holds nothing any more."""
    partial = _partial((8, 32, 32), (1, 32, 32), (8, 8, 8))  # 16 outputs of 8 inputs each
    data = np.arange(8 * 32 * 32, dtype=F4).reshape(8, 32, 32)
    pieces = _pieces(partial, data)
    store = _split(partial, range(12), tmp_path / "spill", buffer_bytes)
    first, rest = pieces[: len(pieces) // 2], pieces[len(pieces) // 2 :]
    assert store.write_blocking(first) == sum(p[2].nbytes for p in first)
    in_memory = sum(p[2].nbytes for p in first if p[0] < 12)
    assert store.spill_blocking() == in_memory
    assert not any(store.holds_in_memory(flat) for flat in range(partial.n_outputs))
    assert store.memory.statistics().bytes_buffered == 0
    assert store.write_blocking(rest) == sum(p[2].nbytes for p in rest)
    assert store.write_blocking(first[:7]) == 0  # a retried delivery, after the move
    stats = store.statistics()
    assert stats.duplicates == 7
    assert stats.bytes_spilled == data.nbytes
    for flat in range(partial.n_outputs):
        assert np.array_equal(_take(store, partial, flat), _expected(partial, data, flat))
    store.close_blocking()
    assert not (tmp_path / "spill").exists()


def test_a_spill_leaves_outputs_handed_over_alone(tmp_path) -> None:
    """An output assembled and handed over before the move stays the caller's, whole."""
    partial = _partial((6, 4), (1, 4), (6, 1))
    data = np.arange(24, dtype=F4).reshape(6, 4)
    store = _split(partial, {0, 1, 2, 3}, tmp_path / "spill")
    store.write_blocking(_pieces(partial, data))
    taken = _take(store, partial, 0)
    assert store.spill_blocking() == 3 * 6 * F4.itemsize  # outputs 1, 2 and 3
    assert np.array_equal(taken, _expected(partial, data, 0))
    for flat in (1, 2, 3):
        assert np.array_equal(_take(store, partial, flat), _expected(partial, data, flat))
    store.close_blocking()
