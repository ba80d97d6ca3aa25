"""Which pieces a store holds: the ``(output, input)`` pairs it accepted, kept as runs.

Where it runs: pure bookkeeping, under the owning store's lock (task threads and the offload
pool).

A store drops a piece whose pair it accepted before, so a retried delivery or a continued
run's resend never duplicates data. A set of one entry per pair cost about 70 bytes and a
Python step per piece: a rechunk of thin held rows into column strips has millions of pieces
of a few dozen bytes each on every worker, and that set outweighed the data. Here the outputs
accepted from one input are kept as runs of consecutive flat indices (a regular cut sends
each worker a run of outputs, so usually one run per input and worker), checked and updated
with a few numpy operations per batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rechunk_p2p.errors import RechunkRunError


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """**Immutable.** A snapshot of a piece store's counters.

    Attributes
    ----------
    kind
        ``"disk"`` or ``"memory"``.
    pieces
        Distinct pieces accepted since the store was created.
    duplicates
        Pieces dropped because their ``(output, input)`` pair was already stored.
    bytes_written
        Payload bytes accepted (for disk: bytes spilled to the data file, which for object
        dtype is the pickled size).
    bytes_read
        Payload bytes returned by reads (same unit as ``bytes_written``).
    bytes_buffered
        Bytes currently held (memory) or on disk (disk) that have not been read and
        discarded yet. Zero after close.
    outputs
        Output indices that currently have data.
    max_bytes_in_memory
        The most piece bytes the store held in memory at once (memory: everything it held;
        disk: its write buffer, both halves).
    bytes_spilled
        Of ``bytes_written``, the bytes written to disk.
    """

    kind: str
    pieces: int
    duplicates: int
    bytes_written: int
    bytes_read: int
    bytes_buffered: int
    outputs: int
    max_bytes_in_memory: int = 0
    bytes_spilled: int = 0


#: A pair ``(output, input)`` is named by the int ``output * _PAIR_BASE + input`` where one
#: value per pair is wanted (:func:`pair_keys`). Flat chunk indices stay far below it (a task
#: graph of 2**31 chunks does not fit in memory), and keys made with numpy stay within int64.
_PAIR_BASE = 1 << 32
_MAX_OUTPUTS = 1 << 31
_OUT_OF_RANGE = "Chunk indices out of range for the piece ledger"


def pair_keys(
    outputs: Sequence[int] | np.ndarray, inputs: int | Sequence[int] | np.ndarray
) -> np.ndarray:
    """The keys of the pairs ``(outputs[k], inputs[k])`` (or of one input), as int64."""
    outs = np.asarray(outputs, dtype=np.int64).reshape(-1)
    ins = np.asarray(inputs, dtype=np.int64)
    _check_range(outs, ins)
    return outs * _PAIR_BASE + ins


def _check_range(outputs: np.ndarray, inputs: np.ndarray | int) -> None:
    ins = np.asarray(inputs)
    if outputs.size and (
        outputs.min() < 0
        or outputs.max() >= _MAX_OUTPUTS
        or ins.min() < 0
        or ins.max() >= _PAIR_BASE
    ):
        raise RechunkRunError(_OUT_OF_RANGE)


def _runs(sorted_unique: np.ndarray) -> tuple[list[int], list[int]]:
    """Starts and ends (exclusive) of the runs of consecutive values of an ascending array
    without repeats.

    >>> _runs(np.array([1, 2, 3, 7, 9, 10]))
    ([1, 7, 9], [4, 8, 11])
    """
    if not len(sorted_unique):
        return [], []
    first, last = int(sorted_unique[0]), int(sorted_unique[-1])
    if last - first == len(sorted_unique) - 1:  # one run (the usual batch)
        return [first], [last + 1]
    breaks = np.flatnonzero(np.diff(sorted_unique) != 1) + 1
    starts = sorted_unique[np.concatenate(([0], breaks))]
    ends = sorted_unique[np.concatenate((breaks - 1, [len(sorted_unique) - 1]))] + 1
    return starts.tolist(), ends.tolist()


def _merge(
    a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]
) -> tuple[list[int], list[int]]:
    """The union of two sets of disjoint runs, as disjoint runs (touching ones joined)."""
    if not a[0]:
        return b
    if not b[0]:
        return a
    pairs = sorted(zip(a[0] + b[0], a[1] + b[1]))
    starts, ends = [pairs[0][0]], [pairs[0][1]]
    for lo, hi in pairs[1:]:
        if lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def _held_in(runs: tuple[list[int], list[int]], outs: np.ndarray) -> np.ndarray:
    """Whether each of ``outs`` lies in one of the disjoint ``runs`` (starts, ends)."""
    starts, ends = np.asarray(runs[0]), np.asarray(runs[1])
    k = np.searchsorted(starts, outs, side="right") - 1
    return (k >= 0) & (outs < ends[np.maximum(k, 0)])


def ascends(values: np.ndarray) -> bool:
    """Whether ``values`` strictly ascend."""
    return len(values) < 2 or bool((values[1:] > values[:-1]).all())


class PieceLedger:
    """**Guarded by the owning store's lock** (not thread-safe on its own). The bookkeeping
    every store shares: which ``(output, input)`` pairs were stored, and the byte counters.
    """

    __slots__ = (
        "_held",
        "bytes_buffered",
        "bytes_read",
        "bytes_written",
        "duplicates",
        "max_bytes_in_memory",
        "pieces",
    )

    def __init__(self) -> None:
        # input -> (starts, ends) of the runs of outputs accepted from it
        self._held: dict[int, tuple[list[int], list[int]]] = {}
        self.pieces = 0
        self.duplicates = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.bytes_buffered = 0
        self.max_bytes_in_memory = 0

    def in_memory(self, nbytes: int) -> None:
        """The store holds ``nbytes`` of pieces in memory now (keeps the peak)."""
        self.max_bytes_in_memory = max(self.max_bytes_in_memory, nbytes)

    def admit_batch(
        self,
        input_: int,
        outputs: np.ndarray,
        checked: bool = False,
        ascending: bool | None = None,
    ) -> np.ndarray | None:
        """Take the pairs ``(outputs[k], input_)``: ``None`` when every one is new (the usual
        case), else whether each one is (a pair held before, or repeated earlier in the
        batch, is not, and counts a duplicate). ``checked``: the caller knows the indices
        are in range; ``ascending``: whether they strictly ascend, if the caller knows."""
        outs = np.asarray(outputs, dtype=np.int64).reshape(-1)
        if not checked:
            _check_range(outs, input_)
        held = self._held.get(input_)
        if ascending is None:
            ascending = ascends(outs)
        if held is None and ascending:
            self._held[input_] = _runs(outs)
            return None
        fresh = np.ones(len(outs), dtype=bool)
        if held is not None and held[0]:
            fresh &= ~_held_in(held, outs)
        if not ascending:
            once = np.zeros(len(outs), dtype=bool)
            once[np.unique(outs, return_index=True)[1]] = True
            fresh &= once
        taken = np.sort(outs[fresh])
        self._held[input_] = _merge(held or ([], []), _runs(taken))
        if fresh.all():
            return None
        self.duplicates += int(len(outs) - fresh.sum())
        return fresh

    def admit_inputs(self, inputs: Sequence[int], outputs: np.ndarray, ascending: bool) -> bool:
        """Take the pairs of every input of ``inputs`` with every output of ``outputs`` (in
        range, checked by the caller) when all of them are new, and say so; else take none
        and return ``False`` (the caller then admits input by input, counting duplicates).
        ``ascending``: whether ``outputs`` strictly ascend."""
        if not ascending or len(set(inputs)) != len(inputs):
            return False
        held = self._held
        outs = np.asarray(outputs, dtype=np.int64).reshape(-1)
        seen = [input_ for input_ in inputs if input_ in held]
        if seen:
            lo, hi = int(outs[0]), int(outs[-1])
            for input_ in seen:
                starts, ends = held[input_]
                k = bisect.bisect_right(starts, hi) - 1
                if k >= 0 and ends[k] > lo and _held_in(held[input_], outs).any():
                    return False
        runs = _runs(outs)
        for input_ in inputs:
            had = held.get(input_)
            held[input_] = runs if had is None else _merge(had, runs)
        return True

    def forget_batch(self, input_: int, outputs: np.ndarray) -> None:
        """Give admitted pairs back (their write failed; a retry may store them)."""
        held = self._held.get(input_)
        if not held or not held[0]:
            return
        have = np.concatenate([np.arange(lo, hi) for lo, hi in zip(*held)])
        left = have[~np.isin(have, np.asarray(outputs, dtype=np.int64))]
        self._held[input_] = _runs(left)

    def forget_outputs(self, outputs: Iterable[int]) -> None:
        """Give back every pair of ``outputs``, from all inputs (they are assembled again
        from pieces sent anew)."""
        outs = np.unique(np.fromiter(outputs, dtype=np.int64))
        if not len(outs):
            return
        for input_, held in list(self._held.items()):
            if held[0] and _held_in(held, outs).any():
                self.forget_batch(input_, outs)

    def holds(self, output: int, input_: int) -> bool:
        """Whether the pair was accepted (and not given back)."""
        held = self._held.get(input_)
        if not held:
            return False
        k = bisect.bisect_right(held[0], output) - 1
        return k >= 0 and output < held[1][k]

    def admit(self, output: int, input_: int) -> bool:
        """Whether the pair is new (and is now taken); a pair seen before counts a duplicate."""
        return self.admit_batch(input_, np.array([output], dtype=np.int64)) is None

    def admit_keys(self, keys: Iterable[int] | np.ndarray) -> list[bool] | None:
        """:meth:`admit_batch` for pairs of any inputs, given as :func:`pair_keys`: ``None``
        when every pair is new, else whether each one is."""
        keys = np.asarray(keys if isinstance(keys, np.ndarray) else list(keys), dtype=np.int64)
        outs, ins = keys // _PAIR_BASE, keys % _PAIR_BASE
        if not len(keys):
            return None
        if (ins == ins[0]).all():
            fresh = self.admit_batch(int(ins[0]), outs)
            return None if fresh is None else fresh.tolist()
        mask = np.ones(len(keys), dtype=bool)
        for input_ in dict.fromkeys(ins.tolist()):  # in order of first appearance
            rows = np.flatnonzero(ins == input_)
            fresh = self.admit_batch(input_, outs[rows])
            if fresh is not None:
                mask[rows] = fresh
        return None if mask.all() else mask.tolist()

    def forget_keys(self, keys: Iterable[int] | np.ndarray) -> None:
        """Give admitted pairs back, given as :func:`pair_keys`."""
        keys = np.asarray(keys if isinstance(keys, np.ndarray) else list(keys), dtype=np.int64)
        outs, ins = keys // _PAIR_BASE, keys % _PAIR_BASE
        for input_ in np.unique(ins).tolist():
            self.forget_batch(input_, outs[ins == input_])

    def stored(self, pieces: int, nbytes: int, held: bool = True) -> None:
        """``pieces`` of ``nbytes`` were accepted (and are held, unless the store closed
        meanwhile)."""
        self.pieces += pieces
        self.bytes_written += nbytes
        if held:
            self.bytes_buffered += nbytes

    def read(self, nbytes: int) -> None:
        """``nbytes`` were read and discarded."""
        self.bytes_read += nbytes
        self.bytes_buffered -= nbytes

    def moved(self, pieces: int, nbytes: int) -> None:
        """``pieces`` of ``nbytes`` went to another store: counted as never accepted here."""
        self.pieces -= pieces
        self.bytes_written -= nbytes
        self.bytes_buffered -= nbytes

    def clear(self) -> None:
        """The store closed: nothing is held any more (the counters of the past stay)."""
        self._held.clear()
        self.bytes_buffered = 0

    def statistics(self, kind: str, outputs: int) -> StoreStatistics:
        return StoreStatistics(
            kind=kind,
            pieces=self.pieces,
            duplicates=self.duplicates,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
            bytes_buffered=self.bytes_buffered,
            outputs=outputs,
            max_bytes_in_memory=self.max_bytes_in_memory,
            bytes_spilled=self.bytes_written if kind == "disk" else 0,
        )
