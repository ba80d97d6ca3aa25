"""Partials and worker assignment against a brute-force, element-by-element oracle.

Every element of the array is labelled with its global position (``np.arange``); input chunks
are cut into pieces exactly as transfer tasks will cut them, and output chunks are assembled
from those pieces exactly as unpack tasks will assemble them.
"""

from __future__ import annotations

import collections
import itertools
import math
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.planning import Partial, assign_worker, make_partials

from .strategies import brute_piece_pairs, chunk_slices, rechunks

SETTINGS = settings(max_examples=200, deadline=None)


def run_partial(partial: Partial, inputs: dict, expected: dict) -> set:
    """Push one partial's input chunks through its pieces; check its outputs element-wise.

    Returns the global (input index, output index) pair of every piece.
    """
    in_keys = list(partial.input_keys())
    out_keys = list(partial.output_keys())
    assert len(in_keys) == partial.n_inputs and len(out_keys) == partial.n_outputs

    # Transfer side: cut every input chunk; every element goes into exactly one piece.
    pieces = {}
    for flat, key in enumerate(in_keys):
        assert partial.flat_input(key) == flat
        assert partial.input_index(flat) == key
        chunk = inputs[key]
        assert partial.input_shape(flat) == chunk.shape
        seen = np.zeros(chunk.shape, dtype=np.int64)
        for out_flat, slices in partial.pieces_of_input(flat):
            assert 0 <= out_flat < partial.n_outputs
            assert (flat, out_flat) not in pieces
            piece = chunk[slices]
            assert piece.size > 0
            seen[slices] += 1
            pieces[flat, out_flat] = piece
        assert (seen == 1).all()

    # Unpack side: assemble every output chunk; every element is written exactly once.
    used = set()
    for flat, key in enumerate(out_keys):
        assert partial.flat_output(key) == flat
        assert partial.output_index(flat) == key
        want = expected[key]
        assert partial.output_shape(flat) == want.shape
        out = np.full(want.shape, -1, dtype=np.int64)
        count = np.zeros(want.shape, dtype=np.int64)
        placed = list(partial.pieces_of_output(flat))
        assert partial.output_placement(flat) == dict(placed)  # shared by alike outputs
        for in_flat, slices in placed:
            piece = pieces[in_flat, flat]  # KeyError: a piece nobody sent
            assert out[slices].shape == piece.shape  # no silent broadcasting
            out[slices] = piece
            count[slices] += 1
            used.add((in_flat, flat))
        assert (count == 1).all()
        np.testing.assert_array_equal(out, want)
        # inputs_of_output: the same pieces, with global input keys and input slices too.
        detailed = list(partial.inputs_of_output(flat))
        assert [(g, o) for g, _, o in detailed] == [(in_keys[i], s) for i, s in placed]
        for glob, in_slices, out_slices in detailed:
            np.testing.assert_array_equal(inputs[glob][in_slices], want[out_slices])

    # The two sides name the same pieces.
    assert used == set(pieces)
    assert partial.n_pieces == len(pieces)
    return {(in_keys[i], out_keys[o]) for i, o in pieces}


def expected_needs_shuffle(partial: Partial, inputs: dict) -> bool:
    nonempty_inputs = sum(inputs[k].size > 0 for k in partial.input_keys())
    return not (partial.size == 0 or nonempty_inputs == 1 or partial.n_outputs == 1)


@SETTINGS
@given(rechunks(), st.sampled_from([0, 2, 7, 50, 10**6]), st.sampled_from([0, 1, 2, 5, 16]))
def test_every_element_lands_once_in_the_right_place(case, min_elements, max_outputs):
    """Also with neighbouring partials joined (``min_elements``, ``max_outputs``): a joined
    partial is a partial like any other."""
    shape, old, new = case
    array = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    inputs = {k: array[s] for k, s in chunk_slices(old).items()}
    expected = {k: array[s] for k, s in chunk_slices(new).items()}

    partials = make_partials(old, new, min_elements=min_elements, max_outputs=max_outputs)
    fine = make_partials(old, new)
    assert len(partials) <= len(fine)
    if max_outputs:  # joining never makes a partial with more outputs than the limit
        most_fine = max((p.n_outputs for p in fine), default=0)
        assert max((p.n_outputs for p in partials), default=0) <= max(max_outputs, most_fine)
    if len(partials) < len(fine):  # only partials that each shuffle are ever joined
        assert all(p.needs_shuffle for p in fine if p.size)
        assert all(p.needs_shuffle for p in partials)
    assert [p.index for p in partials] == sorted(p.index for p in partials)
    assert len({p.index for p in partials}) == len(partials)

    # Partials are disjoint and cover every input and every output chunk exactly once.
    in_owner = collections.Counter(k for p in partials for k in p.input_keys())
    out_owner = collections.Counter(k for p in partials for k in p.output_keys())
    assert set(in_owner) == set(inputs) and set(in_owner.values()) <= {1}
    assert set(out_owner) == set(expected) and set(out_owner.values()) <= {1}

    pairs = set()
    for p in partials:
        assert p.ndim == len(shape)
        assert p.size == sum(inputs[k].size for k in p.input_keys())
        assert p.size == sum(expected[k].size for k in p.output_keys())
        assert p.needs_shuffle == expected_needs_shuffle(p, inputs)
        pairs |= run_partial(p, inputs, expected)

    # No piece crosses partials: the pairs the partials produce, all within a partial, are
    # every pair of chunks that share an element.
    assert pairs == brute_piece_pairs(shape, old, new)
    assert sum(p.n_pieces for p in partials) == len(pairs)
    assert sum(p.size for p in partials) == array.size


@SETTINGS
@given(rechunks())
def test_flat_indices_reject_chunks_of_other_partials(case):
    _, old, new = case
    partials = make_partials(old, new)
    for p, q in itertools.permutations(partials, 2):
        for key in itertools.islice(q.input_keys(), 3):
            with pytest.raises(IndexError):
                p.flat_input(key)
        for key in itertools.islice(q.output_keys(), 3):
            with pytest.raises(IndexError):
                p.flat_output(key)


@SETTINGS
@given(rechunks(max_ndim=3))
def test_out_of_range_flat_indices_raise(case):
    _, old, new = case
    for p in make_partials(old, new):
        calls = [(m, p.n_inputs) for m in (p.pieces_of_input, p.input_shape, p.input_index)]
        calls += [
            (m, p.n_outputs)
            for m in (p.pieces_of_output, p.inputs_of_output, p.output_shape, p.output_index)
        ]
        for method, n in calls:
            for flat in (-1, n):
                with pytest.raises(IndexError):
                    result = method(flat)
                    if isinstance(result, Iterator):
                        list(result)


def test_flat_index_into_a_grid_without_chunks_raises_index_error():
    # An axis of length 0 with no chunks at all: the partial has no inputs, so input 0 does
    # not exist (this used to divide by zero instead).
    (p,) = make_partials(((), (3,)), ((0,), (1, 2)))
    assert p.n_inputs == 0 and p.n_outputs == 2
    with pytest.raises(IndexError):
        list(p.pieces_of_input(0))
    with pytest.raises(IndexError):
        p.input_shape(0)
    assert [list(p.pieces_of_output(i)) for i in range(2)] == [[], []]


@SETTINGS
@given(rechunks(max_ndim=3))
def test_partials_are_immutable_hashable_and_picklable(case):
    _, old, new = case
    partials = make_partials(old, new)
    again = make_partials(tuple(map(tuple, old)), tuple(map(tuple, new)))
    assert partials == again
    for p, q in zip(partials, again, strict=True):
        assert hash(p) == hash(q)
        for flat in range(min(p.n_outputs, 1)):
            list(p.pieces_of_output(flat))  # fill the cached lookups before pickling
            p.output_placement(flat)
        clone = pickle.loads(pickle.dumps(p))
        assert clone == p and hash(clone) == hash(p)
        for flat in range(p.n_inputs):
            assert list(clone.pieces_of_input(flat)) == list(p.pieces_of_input(flat))
        with pytest.raises(AttributeError):
            p.old_chunks = ()


def test_joining_stops_at_about_the_size_and_keeps_fixed_axes():
    old = ((1,) * 64, (4,) * 16)  # maps of 1 x 4 -> series of 64 x 1 ...
    new = ((4,) * 16, (1,) * 64)  # ... 256 partials of 4 x 4 elements
    assert len(make_partials(old, new)) == 256
    joined = make_partials(old, new, min_elements=64)
    assert len(joined) == 64 and {p.size for p in joined} == {64}
    assert len(make_partials(old, new, min_elements=10**9)) == 1
    kept = make_partials(old, new, min_elements=10**9, fixed_axes=(1,))
    assert len(kept) == 16 and {p.old_grid[1] for p in kept} == {1}


def test_joining_stops_at_the_output_limit():
    """64 KiB chunks (32 x 256 -> 256 x 32 elements of 8 bytes): 2,048 partials of 8 outputs.
    The byte target alone joins them into 16 of 1,024 outputs; with the output limit, each
    holds 128 and the byte target is not reached."""
    old = ((32,) * 64, (256,) * 256)
    new = ((256,) * 8, (32,) * 2048)
    assert len(make_partials(old, new)) == 2048
    by_bytes = make_partials(old, new, min_elements=(64 << 20) // 8)
    assert len(by_bytes) == 16 and {p.n_outputs for p in by_bytes} == {1024}
    limited = make_partials(old, new, min_elements=(64 << 20) // 8, max_outputs=128)
    assert len(limited) == 128 and {p.n_outputs for p in limited} == {128}
    assert {p.n_inputs for p in limited} == {128}
    # A partial that is already past the limit stays as it is (it cannot be split).
    unsplit = make_partials(old, new, max_outputs=4, min_elements=10**9)
    assert len(unsplit) == 2048 and {p.n_outputs for p in unsplit} == {8}


def test_partials_that_need_no_shuffle_are_never_joined():
    old, new = ((10, 10, 10),), ((5,) * 6,)  # each old chunk is sliced: no shuffle
    assert len(make_partials(old, new, min_elements=10**6)) == 3


def test_partial_example():
    # old (4, 2) x (3,), new (3, 3) x (1, 2): one partial, 2 inputs, 4 outputs.
    (p,) = make_partials(((4, 2), (3,)), ((3, 3), (1, 2)))
    assert (p.n_inputs, p.n_outputs, p.n_pieces, p.size) == (2, 4, 6, 18)
    assert list(p.pieces_of_input(0)) == [
        (0, (slice(0, 3), slice(0, 1))),
        (1, (slice(0, 3), slice(1, 3))),
        (2, (slice(3, 4), slice(0, 1))),
        (3, (slice(3, 4), slice(1, 3))),
    ]
    assert list(p.pieces_of_output(3)) == [
        (0, (slice(0, 1), slice(0, 2))),
        (1, (slice(1, 3), slice(0, 2))),
    ]
    assert p.needs_shuffle


@pytest.mark.parametrize(
    "old, new, needs_shuffle",
    [
        (((4,), (3,)), ((2, 2), (1, 2)), False),  # one input: outputs are slices of it
        (((2, 2), (1, 2)), ((4,), (3,)), False),  # one output: a concatenation
        (((0, 4, 0),), ((1, 3),), False),  # one non-empty input among empty ones
        (((0, 0),), ((0, 0, 0),), False),  # no elements
        ((), (), False),  # zero-dimensional: one element, one chunk
        (((2, 2),), ((1, 3),), True),
    ],
)
def test_needs_shuffle_examples(old, new, needs_shuffle):
    (p,) = make_partials(old, new)
    assert p.needs_shuffle is needs_shuffle


# --- worker assignment ----------------------------------------------------------------------

workers_case = st.tuples(st.integers(1, 300), st.integers(1, 40), st.integers(0, 100))


@SETTINGS
@given(workers_case)
def test_assign_worker_balanced_contiguous_blocks(case):
    n_outputs, n_workers, shift = case
    base = [assign_worker(i, n_outputs, n_workers) for i in range(n_outputs)]
    owners = [assign_worker(i, n_outputs, n_workers, shift) for i in range(n_outputs)]
    assert owners == [assign_worker(i, n_outputs, n_workers, shift) for i in range(n_outputs)]
    assert all(0 <= w < n_workers for w in owners)
    # Contiguous blocks in worker order, starting at worker 0, rotated by ``shift``.
    assert base == sorted(base) and base[0] == 0
    assert owners == [(w + shift) % n_workers for w in base]
    assert [(w - shift) % n_workers for w in owners] == base
    # Balanced: block sizes (counting workers with no output) differ by at most one.
    sizes = collections.Counter(owners)
    counts = [sizes.get(w, 0) for w in range(n_workers)]
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == n_outputs


@SETTINGS
@given(workers_case)
def test_assign_worker_rejects_outputs_out_of_range(case):
    n_outputs, n_workers, shift = case
    for flat in (-1, n_outputs):
        with pytest.raises(IndexError):
            assign_worker(flat, n_outputs, n_workers, shift)


def test_assign_worker_examples():
    assert [assign_worker(i, 5, 2) for i in range(5)] == [0, 0, 0, 1, 1]
    assert [assign_worker(i, 3, 4, shift=3) for i in range(3)] == [3, 0, 1]
    assert [assign_worker(i, 4, 4, shift=1) for i in range(4)] == [1, 2, 3, 0]


def test_outputs_alike_on_every_axis_share_their_placement():
    # maps to time series: 4 steps of 8 x 8 -> 2 x 2 tiles of 4 x 4, all steps
    (p,) = make_partials(((1,) * 4, (8,), (8,)), ((4,), (4, 4), (4, 4)))
    assert p.n_outputs == 4
    shared = p.output_placement(0)
    assert all(p.output_placement(f) is shared for f in range(4))
    assert shared == {t: (slice(t, t + 1), slice(0, 4), slice(0, 4)) for t in range(4)}
    # uneven tiles: the last column block is narrower, so its outputs differ
    (q,) = make_partials(((1,) * 4, (8,), (7,)), ((4,), (4, 4), (4, 3)))
    assert q.output_placement(0) is q.output_placement(2)
    assert q.output_placement(0) is not q.output_placement(1)
    assert q.output_placement(1) == dict(q.pieces_of_output(1))
    assert q.output_placement(1)[2][2] == slice(0, 3)
