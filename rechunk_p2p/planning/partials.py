"""N-dimensional sub-shuffles (partials) and the pieces that flow through them.

Where it runs: pure (no asyncio, no distributed); used on the client to build the graph and in
task threads to cut input chunks into pieces and to assemble output chunks.

A partial is the product of one :class:`~rechunk_p2p.planning.axes.AxisGroup` per axis: its
input chunks send data only to its output chunks. Inside a partial, chunks are addressed by
*flat* indices (C order over the partial's chunk grid); a piece is the intersection of one
input chunk with one output chunk, named by the pair of flat indices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.planning.axes import AxisPiece, Chunks, axis_pieces

NDIndex = tuple[int, ...]

#: :meth:`Partial.places` keeps the bounds of this many ranges of outputs (a worker's
#: batches to each destination name a few ranges, one per destination).
_KEPT_RANGES = 256


@dataclass(frozen=True)
class Partial:
    """**Immutable.** One independent sub-shuffle of a rechunk.

    Parameters
    ----------
    index
        Position of the partial in the grid of partials.
    old_offset, new_offset
        Global chunk index of the partial's first input and output chunk, per axis.
    old_chunks, new_chunks
        The partial's own input and output chunk lengths, per axis.
    """

    index: NDIndex
    old_offset: NDIndex
    new_offset: NDIndex
    old_chunks: Chunks
    new_chunks: Chunks
    _pieces: tuple[tuple[AxisPiece, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pieces = tuple(axis_pieces(o, n) for o, n in zip(self.old_chunks, self.new_chunks))
        object.__setattr__(self, "_pieces", pieces)

    @property
    def ndim(self) -> int:
        return len(self.old_chunks)

    @cached_property
    def old_grid(self) -> NDIndex:
        """Number of input chunks per axis."""
        return tuple(len(c) for c in self.old_chunks)

    @cached_property
    def new_grid(self) -> NDIndex:
        """Number of output chunks per axis."""
        return tuple(len(c) for c in self.new_chunks)

    @property
    def n_inputs(self) -> int:
        return math.prod(self.old_grid)

    @property
    def n_outputs(self) -> int:
        return math.prod(self.new_grid)

    @property
    def n_pieces(self) -> int:
        """Number of non-empty (input chunk, output chunk) intersections."""
        return math.prod(len(p) for p in self._pieces)

    @property
    def size(self) -> int:
        """Number of array elements in the partial."""
        return math.prod(sum(c) for c in self.old_chunks)

    @property
    def needs_shuffle(self) -> bool:
        """Whether data must move between chunks through a P2P shuffle.

        A partial with one input chunk (outputs are slices of it) or one output chunk
        (a concatenation of its inputs), or with no elements, is built by plain tasks.
        """
        return self.size > 0 and self.n_nonempty_inputs > 1 and self.n_outputs > 1

    @property
    def n_nonempty_inputs(self) -> int:
        """Input chunks with elements."""
        return math.prod(sum(1 for c in axis if c) for axis in self.old_chunks)

    def input_keys(self) -> Iterator[NDIndex]:
        """Global chunk indices of the partial's inputs, in flat order."""
        ranges = (range(o, o + n) for o, n in zip(self.old_offset, self.old_grid))
        return itertools.product(*ranges)

    def output_keys(self) -> Iterator[NDIndex]:
        """Global chunk indices of the partial's outputs, in flat order."""
        ranges = (range(o, o + n) for o, n in zip(self.new_offset, self.new_grid))
        return itertools.product(*ranges)

    def flat_input(self, global_index: NDIndex) -> int:
        """Flat index within the partial of the input chunk at ``global_index``."""
        return _ravel(global_index, self.old_offset, self.old_grid)

    def flat_output(self, global_index: NDIndex) -> int:
        """Flat index within the partial of the output chunk at ``global_index``."""
        return _ravel(global_index, self.new_offset, self.new_grid)

    def output_index(self, flat: int) -> NDIndex:
        """Global chunk index of the output chunk with flat index ``flat``."""
        return tuple(o + i for o, i in zip(self.new_offset, _unravel(flat, self.new_grid)))

    def input_index(self, flat: int) -> NDIndex:
        """Global chunk index of the input chunk with flat index ``flat``."""
        return tuple(o + i for o, i in zip(self.old_offset, _unravel(flat, self.old_grid)))

    def output_shape(self, flat: int) -> tuple[int, ...]:
        """Shape of the output chunk with flat index ``flat``."""
        local = _unravel(flat, self.new_grid)
        return tuple(c[i] for c, i in zip(self.new_chunks, local))

    def output_sizes(self, flats: np.ndarray) -> np.ndarray:
        """Number of elements of each output chunk in ``flats`` (flat indices), at once.

        >>> p = Partial((0, 0), (0, 0), (0, 0), ((2, 2), (4,)), ((4,), (1, 3)))
        >>> p.output_sizes(np.array([1, 0])).tolist()
        [12, 4]
        """
        local = np.unravel_index(np.asarray(flats, dtype=np.int64), self.new_grid)
        sizes = np.ones(len(flats), dtype=np.int64)
        for chunks, index in zip(self.new_chunks, local):
            sizes *= np.asarray(chunks, dtype=np.int64)[index]
        return sizes

    def output_shapes(self, flats: np.ndarray) -> np.ndarray:
        """Shapes of the output chunks ``flats`` (flat indices), one row each, at once.

        >>> p = Partial((0, 0), (0, 0), (0, 0), ((2, 2), (4,)), ((4,), (1, 3)))
        >>> p.output_shapes(np.array([1, 0])).tolist()
        [[4, 3], [4, 1]]
        """
        local = np.unravel_index(np.asarray(flats, dtype=np.int64), self.new_grid)
        columns = [np.asarray(c, dtype=np.int64)[i] for c, i in zip(self.new_chunks, local)]
        return np.stack(columns, axis=1).reshape(len(flats), self.ndim)

    @cached_property
    def _starts(self) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per axis, where each input and each output chunk starts (one extra entry: the end)."""
        old = tuple(np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in self.old_chunks)
        new = tuple(np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in self.new_chunks)
        return old, new

    def places(self, input_: int, outputs: np.ndarray | range) -> tuple[np.ndarray, np.ndarray]:
        """Where input chunk ``input_``'s piece of each output chunk in ``outputs`` lies in
        that output: its start and its length per axis, one row per output, computed for all
        outputs at once (a length of 0 or less: the input has no piece of that output).
        A ``range`` of outputs (a batch to one worker) keeps its outputs' bounds for the next
        input.

        >>> p = Partial((0, 0), (0, 0), (0, 0), ((3, 3), (4,)), ((6,), (2, 2)))
        >>> starts, lengths = p.places(1, np.array([0, 1]))
        >>> starts.tolist(), lengths.tolist()
        ([[3, 0], [3, 0]], [[3, 2], [3, 2]])
        """
        starts, lengths = self.places_of([input_], outputs)
        return starts[0], lengths[0]

    def places_of(
        self, inputs: list[int], outputs: np.ndarray | range
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`places` of several inputs at once: arrays of shape
        ``(len(inputs), len(outputs), ndim)``.

        >>> p = Partial((0, 0), (0, 0), (0, 0), ((3, 3), (4,)), ((6,), (2, 2)))
        >>> p.places_of([0, 1], range(2))[0][:, 0].tolist()
        [[0, 0], [3, 0]]
        """
        flats = np.asarray(inputs, dtype=np.int64)
        if len(flats) and (flats.min() < 0 or flats.max() >= self.n_inputs):
            raise IndexError(f"Flat indices {inputs} outside grid {self.old_grid}")
        local_in = np.unravel_index(flats, self.old_grid)
        shape = (len(flats), len(outputs), self.ndim)
        starts = np.empty(shape, dtype=np.int64)
        lengths = np.empty(shape, dtype=np.int64)
        old = self._starts[0]
        for axis, (i, (begin, end)) in enumerate(zip(local_in, self._output_bounds(outputs))):
            first, stop = old[axis][i][:, None], old[axis][i + 1][:, None]
            lo = np.maximum(first, begin)
            starts[:, :, axis] = lo - begin
            lengths[:, :, axis] = np.minimum(stop, end) - lo
        return starts, lengths

    def _output_bounds(self, outputs: np.ndarray | range) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per axis, where each of ``outputs`` starts and ends (kept for a ``range``)."""
        cache = self._bounds_of_ranges
        key = (outputs.start, outputs.stop, outputs.step) if isinstance(outputs, range) else None
        bounds = cache.get(key) if key is not None else None
        if bounds is None:
            new = self._starts[1]
            flats = np.asarray(outputs, dtype=np.int64)
            local = np.unravel_index(flats, self.new_grid)
            bounds = [(new[a][o], new[a][o + 1]) for a, o in enumerate(local)]
            if key is not None:
                if len(cache) >= _KEPT_RANGES:
                    cache.clear()
                cache[key] = bounds
        return bounds

    @cached_property
    def _bounds_of_ranges(self) -> dict[tuple[int, int, int], list]:
        return {}

    def input_shape(self, flat: int) -> tuple[int, ...]:
        """Shape of the input chunk with flat index ``flat``."""
        local = _unravel(flat, self.old_grid)
        return tuple(c[i] for c, i in zip(self.old_chunks, local))

    @cached_property
    def _by_old(self) -> tuple[dict[int, tuple[AxisPiece, ...]], ...]:
        return tuple(_index_by(pieces, "old") for pieces in self._pieces)

    @cached_property
    def _by_new(self) -> tuple[dict[int, tuple[AxisPiece, ...]], ...]:
        return tuple(_index_by(pieces, "new") for pieces in self._pieces)

    @cached_property
    def _cuts_by_old(self) -> tuple[dict[int, tuple[list[int], list[slice]]], ...]:
        """Per axis: old chunk index -> (new chunk indices, slices of the old chunk). Equal
        lists of new chunk indices are one list (:meth:`input_outputs` names a cut by them)."""
        out = []
        for by_old in self._by_old:
            interned: dict[tuple[int, ...], list[int]] = {}
            out.append(
                {
                    k: (
                        interned.setdefault(tuple(p.new for p in v), [p.new for p in v]),
                        [p.old_slice for p in v],
                    )
                    for k, v in by_old.items()
                }
            )
        return tuple(out)

    @cached_property
    def _cuts_by_new(self) -> tuple[dict[int, tuple[list[int], list[slice]]], ...]:
        """Per axis: new chunk index -> (old chunk indices, slices of the new chunk)."""
        return tuple(
            {k: ([p.old for p in v], [p.new_slice for p in v]) for k, v in by_new.items()}
            for by_new in self._by_new
        )

    def pieces_of_input(self, flat: int) -> Iterator[tuple[int, tuple[slice, ...]]]:
        """Cut input chunk ``flat``: yield (flat output index, slices of the input chunk)."""
        local = _unravel(flat, self.old_grid)
        cuts = [by_old.get(i, ([], [])) for by_old, i in zip(self._cuts_by_old, local)]
        return _pair_up(cuts, self.new_grid)

    def input_cuts(self, flat: int) -> tuple[list[list[int]], list[list[slice]]]:
        """How input chunk ``flat`` is cut, per axis: the new chunk indices (local to the
        partial) its pieces go to, and the slices of the chunk that are those pieces."""
        local = _unravel(flat, self.old_grid)
        cuts = [by_old.get(i, ([], [])) for by_old, i in zip(self._cuts_by_old, local)]
        return [c[0] for c in cuts], [c[1] for c in cuts]

    @cached_property
    def _cut_lengths_by_old(self) -> tuple[dict[int, int | None], ...]:
        """Per axis: old chunk index -> the length of each of its pieces, if all have one."""
        out = []
        for by_old in self._by_old:
            lengths = {}
            for k, pieces in by_old.items():
                sizes = {p.old_stop - p.old_start for p in pieces}
                lengths[k] = sizes.pop() if len(sizes) == 1 else None
            out.append(lengths)
        return tuple(out)

    def input_cut_lengths(self, flat: int) -> list[int | None]:
        """Per axis, the one length of every piece of input chunk ``flat`` along it (``None``
        where pieces differ): a cut is regular where every axis has one.

        >>> Partial((0,), (0,), (0,), ((4, 3),), ((2, 2, 3),)).input_cut_lengths(0)
        [2]
        """
        local = _unravel(flat, self.old_grid)
        return [by_old.get(i) for by_old, i in zip(self._cut_lengths_by_old, local)]

    @cached_property
    def _outputs_by_cut(self) -> dict[tuple[int, ...], np.ndarray]:
        return {}

    def input_outputs(self, flat: int) -> np.ndarray:
        """Flat indices of the outputs input chunk ``flat`` has a piece of, in C order
        (:meth:`flat_outputs` of its cut): one read-only array shared by the inputs cut
        alike (every row of rows into column strips), computed once.

        >>> p = Partial((0, 0), (0, 0), (0, 0), ((1, 1), (4,)), ((2,), (2, 2)))
        >>> p.input_outputs(1).tolist(), p.input_outputs(0) is p.input_outputs(1)
        ([0, 1], True)
        """
        indices, _ = self.input_cuts(flat)
        if not all(indices):
            return np.zeros(0, dtype=np.int64)
        # the lists live in _cuts_by_old as long as the partial: their ids name the cut
        key = tuple(map(id, indices))
        outputs = self._outputs_by_cut.get(key)
        if outputs is None:
            outputs = self.flat_outputs(indices)
            outputs.flags.writeable = False
            outputs = self._outputs_by_cut.setdefault(key, outputs)
        return outputs

    def flat_outputs(self, indices: list[list[int]]) -> np.ndarray:
        """Flat output indices of every combination of one new chunk index per axis, in C order.

        >>> p = Partial((0,), (0,), (0,), ((4,),), ((2, 2),))
        >>> p.flat_outputs([[0, 1]]).tolist()
        [0, 1]
        """
        flat = np.zeros((), dtype=np.int64)
        for axis, chosen in enumerate(indices):
            stride = math.prod(self.new_grid[axis + 1 :])
            flat = np.add.outer(flat, np.asarray(chosen, dtype=np.int64) * stride)
        return flat.ravel()

    def pieces_of_output(self, flat: int) -> Iterator[tuple[int, tuple[slice, ...]]]:
        """Pieces of output chunk ``flat``: yield (flat input index, slices of the output chunk)."""
        local = _unravel(flat, self.new_grid)
        cuts = [by_new.get(i, ([], [])) for by_new, i in zip(self._cuts_by_new, local)]
        return _pair_up(cuts, self.old_grid)

    @cached_property
    def _new_classes(self) -> tuple[dict[int, int], ...]:
        """Per axis: new chunk index -> the first new chunk index cut from the same old
        chunks at the same places of the new chunk (outputs alike on every axis have
        their pieces from the same inputs, at the same places)."""
        classes = []
        for by_new in self._cuts_by_new:
            first: dict[tuple, int] = {}
            classes.append(
                {
                    k: first.setdefault((tuple(old), tuple((s.start, s.stop) for s in sl)), k)
                    for k, (old, sl) in by_new.items()
                }
            )
        return tuple(classes)

    @cached_property
    def _placements(self) -> dict[NDIndex, dict[int, tuple[slice, ...]]]:
        """The placements built so far, by class of output (see :meth:`output_placement`)."""
        return {}

    def output_placement(self, flat: int) -> dict[int, tuple[slice, ...]]:
        """Where the pieces of output chunk ``flat`` lie in it: ``{flat input index: slices of
        the output chunk}``, as :meth:`pieces_of_output` yields them.

        Outputs alike on every axis share one mapping (all the time series of maps to time
        series, all the column blocks of row blocks to column blocks): do not modify it.

        >>> p = Partial((0, 0), (0, 0), (0, 0), ((1, 1), (4,)), ((2,), (2, 2)))
        >>> p.output_placement(0) is p.output_placement(1)
        True
        >>> p.output_placement(1)
        {0: (slice(0, 1, None), slice(0, 2, None)), 1: (slice(1, 2, None), slice(0, 2, None))}
        """
        local = _unravel(flat, self.new_grid)
        key = tuple(c.get(i, -1) for c, i in zip(self._new_classes, local))
        placement = self._placements.get(key)
        if placement is None:  # (two threads may both build it: the same mapping)
            placement = self._placements.setdefault(key, dict(self.pieces_of_output(flat)))
        return placement

    def stacked_inputs(self, flat: int) -> list[int] | None:
        """The inputs of output chunk ``flat`` in the order their pieces lie one after another
        in the output's memory (C order), when they do; ``None`` when a piece is a strided
        region of the output.

        They do when the output is cut along one axis only and has extent 1 along every
        axis before it: maps to time series, row blocks to column blocks.

        >>> Partial((0, 0), (0, 0), (0, 0), ((1, 1), (4,)), ((2,), (2, 2))).stacked_inputs(1)
        [0, 1]
        >>> Partial((0, 0), (0, 0), (0, 0), ((2,), (2, 2)), ((2,), (4,))).stacked_inputs(0)
        """
        local = _unravel(flat, self.new_grid)
        cuts = [by_new.get(i, ([], [])) for by_new, i in zip(self._cuts_by_new, local)]
        split = [a for a, (indices, _) in enumerate(cuts) if len(indices) > 1]
        if len(split) > 1 or any(
            self.new_chunks[a][local[a]] != 1 for a in range(split[0] if split else 0)
        ):
            return None
        return [i for i, _ in _pair_up(cuts, self.old_grid)]

    def inputs_of_output(
        self, flat: int
    ) -> Iterator[tuple[NDIndex, tuple[slice, ...], tuple[slice, ...]]]:
        """Global input index, input slices and output slices of every piece of output ``flat``."""
        local = _unravel(flat, self.new_grid)
        per_axis = [by_new.get(i, ()) for by_new, i in zip(self._by_new, local)]
        for combo in itertools.product(*per_axis):
            glob = tuple(o + p.old for o, p in zip(self.old_offset, combo))
            yield glob, tuple(p.old_slice for p in combo), tuple(p.new_slice for p in combo)


def _pair_up(
    cuts: list[tuple[list[int], list[slice]]], grid: NDIndex
) -> Iterator[tuple[int, tuple[slice, ...]]]:
    """(flat index, slices) for every combination of one cut per axis, in C order.

    Flat indices are computed for all combinations at once: this runs once per piece of a
    rechunk, so it avoids a Python-level loop per combination.
    """
    if not cuts:
        return iter([(0, ())])
    if any(not indices for indices, _ in cuts):
        return iter([])
    strides = [math.prod(grid[a + 1 :]) for a in range(len(grid))]
    flat = np.zeros((), dtype=np.int64)
    for (indices, _), stride in zip(cuts, strides):
        flat = np.add.outer(flat, np.asarray(indices, dtype=np.int64) * stride)
    return zip(flat.ravel().tolist(), itertools.product(*(sl for _, sl in cuts)))


def _index_by(pieces: tuple[AxisPiece, ...], attr: str) -> dict[int, tuple[AxisPiece, ...]]:
    out: dict[int, list[AxisPiece]] = {}
    for p in pieces:
        out.setdefault(getattr(p, attr), []).append(p)
    return {k: tuple(v) for k, v in out.items()}


def _ravel(global_index: NDIndex, offset: NDIndex, grid: NDIndex) -> int:
    return _ravel_local(tuple(g - o for g, o in zip(global_index, offset)), grid)


def _ravel_local(local: NDIndex, grid: NDIndex) -> int:
    flat = 0
    for i, n in zip(local, grid):
        if not 0 <= i < n:
            raise IndexError(f"Chunk index {local} outside grid {grid}")
        flat = flat * n + i
    return flat


def _unravel(flat: int, grid: NDIndex) -> NDIndex:
    if not 0 <= flat < math.prod(grid):
        raise IndexError(f"Flat index {flat} outside grid {grid}")
    out = []
    for n in reversed(grid):
        flat, i = divmod(flat, n)
        out.append(i)
    return tuple(reversed(out))


def assign_worker(flat: int, n_outputs: int, n_workers: int, shift: int = 0) -> int:
    """Position of the worker that owns output ``flat``: contiguous, balanced blocks.

    Output ``i`` of ``n`` goes to block ``i * w // n``; blocks differ in size by at most one.
    ``shift`` rotates the blocks so that many small partials spread over all workers.

    >>> [assign_worker(i, 5, 2) for i in range(5)]
    [0, 0, 0, 1, 1]
    >>> [assign_worker(i, 3, 4, shift=3) for i in range(3)]
    [3, 0, 1]
    """
    if not 0 <= flat < n_outputs:
        raise IndexError(f"Output {flat} outside 0..{n_outputs - 1}")
    return (flat * n_workers // n_outputs + shift) % n_workers


def memory_weights(limits: Sequence[float]) -> tuple[float, ...] | None:
    """Workers' memory limits as weights for :func:`proportional_blocks`; ``None`` (place by
    count) unless every worker has one.

    >>> memory_weights([2, 8]), memory_weights([2, 0])
    ((2, 8), None)
    """
    weights = tuple(limits)
    return weights if weights and min(weights) > 0 else None


def proportional_blocks(n_items: int, weights: Sequence[float]) -> np.ndarray:
    """Block of each of ``n_items`` items in order: contiguous blocks, one a weight, block
    ``k`` about ``n_items * weights[k] / sum(weights)`` long (equal weights: the blocks of
    :func:`assign_worker`).

    >>> proportional_blocks(5, (1, 1)).tolist()
    [0, 0, 0, 1, 1]
    >>> proportional_blocks(10, (2, 8)).tolist()
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    """
    if not weights or min(weights) <= 0:
        raise RechunkInputError(f"Worker weights must be positive, got {tuple(weights)}")
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64))
    # block k ends at ceil(n * W_k / W), W_k the sum of the first k + 1 weights
    ends = np.ceil(np.round(n_items * cumulative / cumulative[-1], 9)).astype(np.int64)
    return np.searchsorted(ends, np.arange(n_items, dtype=np.int64), side="right")
