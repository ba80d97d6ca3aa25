"""A memory store that assembles each output chunk as its pieces arrive.

Where it runs: offload pool and task threads (blocking; never on the event loop).

Each piece is copied into its output chunk when it is written, so a batch's buffer is free
as soon as the batch is stored, the worker holds its share of the data once, and reading an
output after the barrier only hands the array over.

Outputs are allocated in *slabs*: the outputs of one shape that a batch is the first to
reach, in one array of shape ``(outputs, *output_shape)``, each output a C-contiguous view
of it. A batch of a regular cut (one input's pieces of one shape, as
:func:`~rechunk_p2p.transport.wire.pack_blocks` makes it) usually has the same place in each of
its outputs (a row of every column strip, a time step of every time series), so its pieces
are placed with one strided copy per slab and place, whatever their number: a worker
receiving thin held rows (thousands of pieces of a few dozen bytes per input chunk) pays per
batch, not per piece. Where pieces are large, outputs get pages of their own instead
(:func:`~rechunk_p2p.store.base.empty_output`, whose freed pages serve the next output)
and each piece is one copy. Bookkeeping is numpy arrays indexed by output and a ledger of
runs (:class:`~rechunk_p2p.store.ledger.PieceLedger`), never an object per piece.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rechunk_p2p.errors import RechunkRunError, RechunkTypeError
from rechunk_p2p.planning import Partial
from rechunk_p2p.store.base import (
    OWN_PAGES_BYTES,
    Piece,
    StoreKind,
    StoreStatistics,
    check_array,
    check_piece,
    closed_error,
    empty_output,
    touch_pages_blocking,
)
from rechunk_p2p.store.ledger import PieceLedger, ascends
from rechunk_p2p.store.placing import FEW_PIECES, copy_inputs_blocking, copy_pieces_blocking
from rechunk_p2p.transport.wire import Packed, unpack_blocking, unpack_blocks

if TYPE_CHECKING:
    from rechunk_p2p.spec import ShuffleSpec

#: Outputs first reached by one batch share slabs when its pieces are at most this large:
#: below it, a Python step per piece costs about as much as its copy or more (one strided
#: copy of a batch into a slab is several times faster than piece by piece); above
#: it, each output gets pages of its own, which the next output of its size takes over
#: when it is freed.
SLAB_PIECE_BYTES = 64 * 2**10
#: A slab holds at most this many bytes (or one output): an output handed over keeps its
#: slab alive, so a slab is the unit in which memory returns once outputs are consumed.
SLAB_BYTES = 64 * 2**20


class AssemblingMemoryStore:
    """**Thread-safe (guarded by `_lock`).** Copies each piece into its output chunk on write.

    Pieces are copied outside the lock, from any number of threads (they fill disjoint
    regions); :meth:`take_output_blocking` waits for copies into that output still in
    progress. Not for object dtype, nor for axes of unknown chunk sizes (the output's shape
    must be known before its first piece arrives).

    Parameters
    ----------
    dtype
        The dtype of every piece and output.
    name
        Names the store in error messages.
    partial
        The sub-shuffle: output shapes and where each input's piece lies in each output.
    """

    kind: StoreKind = "memory"
    copies_pieces = True  # (pieces are copied into their outputs)
    fills_outputs = True

    def __init__(self, dtype: np.dtype, name: str, partial: Partial) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise RechunkTypeError(f"{type(self).__name__} cannot hold object dtype")
        self.name = name
        self._partial = partial
        self._lock = threading.Condition()
        self._closed = False
        n = partial.n_outputs
        self._slab_of = np.full(n, -1, dtype=np.int64)  # -1: not allocated (or taken)
        self._slot_of = np.zeros(n, dtype=np.int64)
        self._writing = np.zeros(n, dtype=np.int32)  # copies into an output in progress
        self._placed = np.zeros(n, dtype=np.int32)  # inputs whose piece was copied in
        self._piece_bytes = np.zeros(n, dtype=np.int64)
        # outputs handed over, and the inputs placed in those made again by late pieces
        self._taken = np.zeros(n, dtype=bool)
        self._late: dict[int, set[int]] = {}
        self._slabs: dict[int, np.ndarray] = {}  # id -> (outputs, *shape)
        self._left: dict[int, int] = {}  # id -> outputs of the slab not taken yet
        self._next_slab = 0
        self._held = 0  # bytes of outputs allocated and not taken yet
        self._ledger = PieceLedger()
        # outputs' placements, and each place's slices -> (slices, piece shape, start):
        # see _few_places
        self._placements: dict[int, Mapping[int, tuple[slice, ...]]] = {}
        self._pieces: dict[int, tuple[tuple[slice, ...], tuple[int, ...], list[int]]] = {}

    def __repr__(self) -> str:
        return f"<AssemblingMemoryStore {self.name!r} dtype={self.dtype}>"

    # -- writing -----------------------------------------------------------------------

    def write_blocks_blocking(
        self, outputs: Sequence[int] | np.ndarray, input_: int, blocks: np.ndarray
    ) -> int:
        """Copy pieces ``blocks[i]`` of outputs ``outputs[i]``, all from input ``input_`` and
        of one shape, into their outputs, dropping pairs stored before; return the bytes
        accepted. The whole batch is checked before anything is stored. ``outputs`` may be
        a ``range`` (consecutive outputs, the usual batch: its bookkeeping is by slices).

        Raises
        ------
        RechunkTypeError
            ``blocks`` is not an array of the store's dtype.
        RechunkRunError
            The store is closed, ``blocks`` does not hold one piece per output, or a piece
            is not input ``input_``'s piece of its output.
        """
        input_ = operator.index(input_)
        blocks = check_array(blocks, self.dtype, self.kind, self.name, f"input {input_}'s batch")
        span = outputs if isinstance(outputs, range) and outputs.step == 1 else None
        if span is not None:
            outs = np.arange(span.start, span.stop, dtype=np.int64)
        else:
            outs = np.asarray(outputs, dtype=np.int64).reshape(-1)
        if blocks.ndim < 1 or len(blocks) != len(outs):
            raise RechunkRunError(
                f"Store {self.name!r} got {len(outs)} outputs and blocks of shape "
                f"{blocks.shape} from input {input_}: one block per output expected"
            )
        if not len(outs):
            return 0
        starts = self._checked_places(outs, input_, blocks.shape[1:], span)
        return self._write_checked_blocking(input_, outs, starts, blocks, span)

    def _checked_places(
        self, outs: np.ndarray, input_: int, shape: tuple[int, ...], span: range | None = None
    ) -> np.ndarray:
        """Where input ``input_``'s pieces of ``shape`` start in outputs ``outs`` (``span``:
        the same, consecutive), after checking that each is that input's piece of its output."""
        if len(outs) <= FEW_PIECES:  # (a few numpy passes cost more than a loop then)
            return self._few_places(outs.tolist(), input_, shape)
        self._check_outputs(outs, input_, span)
        starts, lengths = self._partial.places(input_, outs if span is None else span)
        self._check_places(outs, input_, lengths, shape)
        return starts

    def _few_places(self, outs: list[int], input_: int, shape: tuple[int, ...]) -> np.ndarray:
        """:meth:`Partial.places` of a few outputs, checked, from the placements the partial
        keeps per kind of output."""
        partial, known, starts = self._partial, self._placements, []
        for output in outs:
            where = None
            if 0 <= output < partial.n_outputs:
                placement = known.get(output)
                if placement is None:
                    placement = known[output] = partial.output_placement(output)
                where = placement.get(input_)
            if where is None:
                raise RechunkRunError(
                    f"Store {self.name!r} got a piece of output {output} from input {input_}, "
                    "which has no piece of that output"
                )
            # (a placement's slices live as long as the partial: their id names them)
            hit = self._pieces.get(id(where))
            if hit is None or hit[0] is not where:
                piece = tuple(s.stop - s.start for s in where)
                hit = self._pieces[id(where)] = (where, piece, [s.start for s in where])
            if hit[1] != tuple(shape):
                raise RechunkRunError(
                    f"Store {self.name!r} got a piece of shape {tuple(shape)} for output "
                    f"{output} from input {input_}; its piece there has shape {hit[1]}"
                )
            starts.append(hit[2])
        return np.array(starts, dtype=np.int64).reshape(len(outs), len(shape))

    def write_blocking(self, pieces: Iterable[Piece]) -> int:
        """Copy pieces (of any inputs and shapes) into their outputs, dropping pairs stored
        before; return the bytes accepted. Raises as :meth:`write_blocks_blocking`."""
        batch = [check_piece(s, self.dtype, self.kind, self.name) for s in pieces]
        by_input: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for k, (_, input_, array) in enumerate(batch):
            by_input.setdefault((input_, array.shape), []).append(k)
        checked = []
        for (input_, shape), rows in by_input.items():
            outs = np.array([batch[k][0] for k in rows], dtype=np.int64)
            starts = self._checked_places(outs, input_, shape)
            blocks = np.empty((len(rows), *shape), dtype=self.dtype)
            for i, k in enumerate(rows):
                blocks[i] = batch[k][2]
            checked.append((input_, outs, starts, blocks))
        return sum(self._write_checked_blocking(*args) for args in checked)

    def write_packed_blocking(self, batch: Iterable[Packed]) -> int:
        """Copy the pieces of batches as they came off the wire into their outputs (the
        batches' payloads are not kept). Consecutive batches of several inputs for the same
        outputs and of one shape (a message's batches from one sender to one worker, each
        of its next input chunk) are written together (:meth:`_write_inputs_blocking`)."""
        accepted = 0
        group: list[tuple[Packed, int, np.ndarray]] = []
        for packed in batch:
            regular = unpack_blocks(packed, self.dtype)
            if group and not (
                regular is not None
                and packed.outputs == group[0][0].outputs
                and regular[1].shape == group[0][2].shape
            ):
                accepted += self._write_group_blocking(group)
                group = []
            if regular is None:
                accepted += self.write_blocking(unpack_blocking(packed, self.dtype))
            else:
                group.append((packed, *regular))
        return accepted + (self._write_group_blocking(group) if group else 0)

    def _write_group_blocking(self, group: list[tuple[Packed, int, np.ndarray]]) -> int:
        outputs = group[0][0].outputs
        if len(group) == 1 or len(outputs) < 2 or group[0][2][0].nbytes > SLAB_PIECE_BYTES:
            return sum(self.write_blocks_blocking(outputs, i, blocks) for _, i, blocks in group)
        return self._write_inputs_blocking(
            outputs, [i for _, i, _ in group], [blocks for _, _, blocks in group]
        )

    def _write_inputs_blocking(
        self, outputs: Sequence[int], inputs: list[int], blocks: list[np.ndarray]
    ) -> int:
        """:meth:`write_blocks_blocking` of several inputs' pieces of the same ``outputs``
        (``blocks[i]``: input ``inputs[i]``'s, all of one shape), checked, admitted and
        accounted once for all of them: a batch costs a Python step and a few numpy passes
        whatever its size, and at many workers a sender's message to one worker holds many
        small batches. Where a pair was stored before, the inputs are written one by one."""
        span = outputs if isinstance(outputs, range) and outputs.step == 1 else None
        if span is not None:
            outs = np.arange(span.start, span.stop, dtype=np.int64)
        else:
            outs = np.asarray(outputs, dtype=np.int64).reshape(-1)
        shape = blocks[0].shape[1:]
        self._check_outputs(outs, min(inputs), span)
        self._check_outputs(outs, max(inputs), span)
        starts, lengths = self._partial.places_of(inputs, outs if span is None else span)
        if (lengths != np.asarray(shape, dtype=np.int64)).any() or not all(n > 0 for n in shape):
            for input_, found in zip(inputs, lengths):  # (raises for the first wrong piece)
                self._check_places(outs, input_, found, shape)
        each, k = blocks[0][0].nbytes, len(inputs)
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write pieces")
            ascending = span is not None or ascends(outs)
            admitted = self._ledger.admit_inputs(inputs, outs, ascending)
            if admitted:
                at = _span(outs) if span is None else slice(span.start, span.stop)
                arrays, slabs, slots, runs = self._begin_locked(inputs, outs, at, each)
        if not admitted:  # (duplicates: rare)
            return sum(
                self._write_checked_blocking(i, outs, place, b, span)
                for i, place, b in zip(inputs, starts, blocks)
            )
        done = False
        try:
            copy_inputs_blocking(arrays, slabs, slots, starts, blocks, runs)
            done = True
        finally:
            self._finish(inputs, outs, at, each, done)
        return each * len(outs) * k

    def _write_checked_blocking(
        self,
        input_: int,
        outs: np.ndarray,
        starts: np.ndarray,
        blocks: np.ndarray,
        span: range | None = None,
    ) -> int:
        """Admit, allocate, copy and account one checked batch of one input and shape
        (``span``: its outputs, when consecutive)."""
        each = blocks[0].nbytes
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write pieces")
            ascending = True if span is not None else None
            fresh = self._ledger.admit_batch(input_, outs, checked=True, ascending=ascending)
            if fresh is not None:
                outs, starts, blocks = outs[fresh], starts[fresh], blocks[fresh]
                span = None
                if not len(outs):
                    return 0
            # a run of consecutive outputs (the usual batch) is indexed by a slice: views,
            # where an index array costs a gather or scatter per bookkeeping array
            at = _span(outs) if span is None else slice(span.start, span.stop)
            arrays, slabs, slots, runs = self._begin_locked([input_], outs, at, each)
        done = False
        try:
            copy_pieces_blocking(arrays, slabs, slots, starts, blocks, runs)
            done = True
        finally:
            self._finish([input_], outs, at, each, done)
        return each * len(outs)

    def _begin_locked(
        self, inputs: list[int], outs: np.ndarray, at: slice | np.ndarray, each: int
    ) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray, np.ndarray | None]:
        """Allocate admitted pieces' outputs and count a copy into them in progress: the
        slabs, the outputs' slabs and slots, and (``at`` a slice) where runs of one slab
        start, for :func:`~rechunk_p2p.store.placing.copy_pieces_blocking`."""
        self._allocate_locked(outs, at, each)
        taken = self._taken[at]
        if taken.any():  # (late pieces: rare)
            for output in outs[taken].tolist():
                self._late.setdefault(output, set()).update(inputs)
        slabs, slots = self._slab_of[at], self._slot_of[at]
        firsts = np.flatnonzero(slabs[1:] != slabs[:-1]) + 1
        kinds = set(slabs[firsts].tolist())
        kinds.add(int(slabs[0]))
        self._writing[at] += 1
        runs = firsts if isinstance(at, slice) else None
        return {sid: self._slabs[sid] for sid in kinds}, slabs, slots, runs

    def _finish(
        self, inputs: list[int], outs: np.ndarray, at: slice | np.ndarray, each: int, done: bool
    ) -> None:
        """A copy into outputs ``outs`` ended: account the pieces, or give their pairs back."""
        with self._lock:
            self._writing[at] -= 1
            if done:
                self._placed[at] += len(inputs)
                self._piece_bytes[at] += each * len(inputs)
                self._ledger.stored(len(outs) * len(inputs), each * len(outs) * len(inputs))
            else:
                for input_ in inputs:
                    self._ledger.forget_batch(input_, outs)
            self._lock.notify_all()

    def _allocate_locked(self, outs: np.ndarray, at: slice | np.ndarray, piece_bytes: int) -> None:
        """Allocate the outputs of ``outs`` (``at`` indexes them) that have no array yet: one
        slab per shape for small pieces (see :data:`SLAB_PIECE_BYTES`), else one array each.
        A slab's slots follow its outputs' order (the copies rely on it, see
        :func:`~rechunk_p2p.store.placing.copy_pieces_blocking`)."""
        missing = self._slab_of[at] < 0
        if not missing.any():
            return
        new = np.unique(outs[missing])
        shapes = self._partial.output_shapes(new)
        if (shapes == shapes[0]).all():
            groups = [(new, tuple(shapes[0].tolist()))]
        else:
            kinds, which = np.unique(shapes, axis=0, return_inverse=True)
            which = which.reshape(-1)
            groups = [(new[which == g], tuple(kinds[g].tolist())) for g in range(len(kinds))]
        for members, shape in groups:
            nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
            per_slab = 1
            if piece_bytes <= SLAB_PIECE_BYTES or nbytes < OWN_PAGES_BYTES:
                per_slab = max(SLAB_BYTES // max(nbytes, 1), 1)
            for start in range(0, len(members), per_slab):
                self._new_slab_locked(members[start : start + per_slab], shape)

    def _new_slab_locked(self, members: np.ndarray, shape: tuple[int, ...]) -> None:
        slab = empty_output((len(members), *shape), self.dtype)
        touch_pages_blocking(slab)  # (page faults outside the GIL, see there)
        sid = self._next_slab
        self._next_slab += 1
        self._slabs[sid] = slab
        self._left[sid] = len(members)
        self._slab_of[members] = sid
        self._slot_of[members] = np.arange(len(members))
        self._held += slab.nbytes
        self._ledger.in_memory(self._held)

    # -- checks ------------------------------------------------------------------------

    def _check_outputs(self, outs: np.ndarray, input_: int, span: range | None = None) -> None:
        outside = not 0 <= input_ < self._partial.n_inputs
        lo, hi = (span.start, span.stop - 1) if span is not None else (outs.min(), outs.max())
        if lo >= 0 and hi < self._partial.n_outputs and not outside:
            return
        bad = np.flatnonzero((outs < 0) | (outs >= self._partial.n_outputs))
        if len(bad) or outside:
            output = int(outs[bad[0]]) if len(bad) else int(outs[0])
            which = "input" if outside else "output"
            raise RechunkRunError(
                f"Store {self.name!r} got a piece of output {output} from input {input_}, "
                f"which has no piece of that output (the {which} is not in the sub-shuffle)"
            )

    def _check_places(
        self, outs: np.ndarray, input_: int, lengths: np.ndarray, shape: tuple[int, ...]
    ) -> None:
        """Raise unless each piece has the shape of input ``input_``'s piece of its output
        (every piece has elements: a length of 0 or less means there is no piece)."""
        fits = len(shape) == lengths.shape[1] and all(n > 0 for n in shape)
        if fits and not (lengths != np.asarray(shape, dtype=np.int64)).any():
            return  # (the usual case, in one pass)
        absent = np.asarray((lengths <= 0).any(axis=1))
        wrong = absent.copy()
        if len(shape) != lengths.shape[1]:
            wrong[:] = True
        else:
            wrong |= (lengths != np.asarray(shape, dtype=np.int64)).any(axis=1)
        bad = np.flatnonzero(wrong)
        if not len(bad):
            return
        k = int(bad[0])
        output = int(outs[k])
        if absent[k]:
            raise RechunkRunError(
                f"Store {self.name!r} got a piece of output {output} from input {input_}, "
                "which has no piece of that output"
            )
        raise RechunkRunError(
            f"Store {self.name!r} got a piece of shape {tuple(shape)} for output {output} "
            f"from input {input_}; its piece there has shape {tuple(lengths[k].tolist())}"
        )

    # -- reading -----------------------------------------------------------------------

    def take_output_blocking(self, output: int) -> tuple[np.ndarray | None, list[int]]:
        """Hand over output chunk ``output`` and forget it: the array (``None`` if no piece
        of it was written) and the inputs whose pieces it lacks, sorted. Waits for copies
        into it still in progress."""
        with self._lock:
            while self._writing[output] and not self._closed:
                self._lock.wait()
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            expected = self._partial.output_placement(output)
            if self._slab_of[output] < 0:
                return None, sorted(expected)
            placed = int(self._placed[output])
            self._ledger.read(int(self._piece_bytes[output]))
            array = self._let_go_locked(output)
            complete = placed == len(expected)
            missing = [] if complete else self._missing_locked(output, expected)
            self._taken[output] = True
        return array, missing

    def assemble_blocking(self, spec: ShuffleSpec, output: int) -> tuple[np.ndarray, list[int]]:
        """See :meth:`rechunk_p2p.store.base.PieceStore.assemble_blocking`: the output as
        its pieces filled it (an empty one where none came)."""
        out, missing = self.take_output_blocking(output)
        if out is None:
            out = empty_output(self._partial.output_shape(output), self.dtype)
        return out, missing

    def spill_blocking(self) -> int:
        """Nothing moves here: the run's memory share makes it a split store first, which
        spills (:meth:`rechunk_p2p.worker.memory_shares.RunMemory.spillable`)."""
        return 0

    def _let_go_locked(self, output: int) -> np.ndarray:
        """Output ``output``'s array, which the store no longer holds (its slab goes with
        the last of its outputs; the arrays handed out keep it alive)."""
        sid = int(self._slab_of[output])
        array = self._slabs[sid][int(self._slot_of[output])]
        self._slab_of[output] = -1
        self._held -= array.nbytes
        self._left[sid] -= 1
        self._placed[output] = self._piece_bytes[output] = 0
        if not self._left[sid]:
            del self._slabs[sid], self._left[sid]
        return array

    def evict_blocking(self, outputs: Iterable[int]) -> list[Piece]:
        """Give up ``outputs`` and return the pieces placed in them so far, as views of
        their arrays, for another store to keep (the worker is short of memory): the store
        holds them as if none of their pieces had come. Waits for copies into them still in
        progress; the caller sees to it that no more start."""
        pieces: list[Piece] = []
        with self._lock:
            for output in outputs:
                while self._writing[output] and not self._closed:
                    self._lock.wait()
                if self._closed:
                    raise closed_error(self.kind, self.name, f"move output {output}")
                if self._slab_of[output] < 0:
                    continue
                placement = self._partial.output_placement(output)
                held = [i for i in placement if self._ledger.holds(output, i)]
                self._ledger.moved(len(held), int(self._piece_bytes[output]))
                array = self._let_go_locked(output)
                pieces.extend((output, i, array[placement[i]]) for i in held)
                self._ledger.forget_outputs([output])
        return pieces

    def _missing_locked(self, output: int, expected: Iterable[int]) -> list[int]:
        if self._taken[output]:  # made again after it was handed over
            late = self._late.pop(output, set())
            return sorted(i for i in expected if i not in late)
        return sorted(i for i in expected if not self._ledger.holds(output, i))

    def forget_outputs_blocking(self, outputs: Iterable[int]) -> None:
        """Forget that ``outputs`` (read already) got their pieces: they are assembled
        again from pieces sent anew."""
        outputs = list(outputs)
        with self._lock:
            self._ledger.forget_outputs(outputs)
            for output in outputs:
                self._taken[output] = False
                self._late.pop(output, None)

    def close_blocking(self) -> None:
        """Drop every output; idempotent."""
        with self._lock:
            self._closed = True
            self._slabs.clear()
            self._left.clear()
            self._held = 0
            self._ledger.clear()
            self._lock.notify_all()

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters (in memory: the output chunks begun)."""
        with self._lock:
            begun = int((self._slab_of >= 0).sum())
            return self._ledger.statistics(self.kind, outputs=begun)


def _span(outs: np.ndarray) -> slice | np.ndarray:
    """``outs`` as a slice where it is a run of consecutive ascending indices, else itself."""
    first, n = int(outs[0]), len(outs)
    if int(outs[-1]) - first == n - 1 and (n < 3 or (np.diff(outs) == 1).all()):
        return slice(first, first + n)
    return outs
