"""Reading a disk store's pieces back: one output's pieces as arrays, into the output, or
stacked in input order.

Where it runs: task threads (assembling an output), blocking. A part of
:class:`~rechunk_p2p.store.disk.DiskPieceStore`.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import numpy as np

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.store.base import closed_error, owned_array, place_blocking
from rechunk_p2p.store.disk_buffer import WriteBuffer
from rechunk_p2p.store.disk_parts import PieceIndex, SpillFile, StoreCore, rows_by_input
from rechunk_p2p.store.files import preadv_all, read_targets_blocking

_READ_ADVICE = (
    "The spilled data was removed or truncated by something else, or the disk failed; "
    "check the worker's local directory, or buffer pieces in memory with "
    'dask.config.set({"rechunk-p2p.storage": "memory"}).'
)

_T = TypeVar("_T")

#: Below this many bytes per ``pread`` on average, an output's pieces are read in runs of
#: the file into a staging buffer and gathered into place at once (see _gather_blocking).
GATHER_BELOW = 4 << 10


class DiskReads:
    """**Thread-safe (guarded by its store's lock, ``core.lock``).** The reads of a disk
    store's pieces back from ``file``: an output's rows taken from ``index`` once ``buffer``
    wrote what it gathered, then read outside the lock (counted in ``core.inflight``)."""

    def __init__(
        self,
        core: StoreCore,
        index: PieceIndex,
        file: SpillFile,
        buffer: WriteBuffer,
        dtype: np.dtype,
    ) -> None:
        self._core = core
        self._index = index
        self._file = file
        self._buffer = buffer
        self.dtype = dtype
        self._pickled = dtype.hasobject
        self.name = core.name

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """Read one output's pieces back from disk, sorted by input index.

        See :meth:`rechunk_p2p.store.base.PieceStore.read_blocking`. Each array is read
        straight into its own freshly allocated buffer.
        """
        return self._read_output_blocking(output, self._read_entries_blocking)

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """Read each piece of ``output`` straight into ``out[placement[input]]``; discard it.

        Where the target region of ``out`` is contiguous (e.g. a slab along the first axis),
        ``preadv`` fills it directly: no buffer per piece and no second copy. Returns the
        input indices placed.
        """

        def read(fd: int, rows: np.ndarray) -> list[int]:
            self._read_into_entries_blocking(fd, rows, out, placement)
            return rows["input"].tolist()

        return self._read_output_blocking(output, read)

    def read_stacked_blocking(self, output: int, out: np.ndarray, order: list[int]) -> list[int]:
        """Read the pieces of ``output`` one after another into C-contiguous ``out``, in the
        order of the inputs ``order``, and discard them.

        See :meth:`rechunk_p2p.store.memory.MemoryPieceStore.read_stacked_blocking`. Each
        run of pieces that lie one after another in the data file too is one ``pread``
        straight into its bytes of ``out``. Returns the inputs placed, in order, stopping at
        the first one missing. Not for object dtype.
        """

        def read(fd: int, rows: np.ndarray) -> list[int]:
            return self._read_stacked_entries_blocking(fd, output, rows, out, order)

        return self._read_output_blocking(output, read)

    def _take_entries(self, output: int) -> np.ndarray | None:
        """Remove and return the index rows of ``output``, sorted by input (one reader at a
        time writes the buffer and files what is new)."""
        with self._index.sorting:
            self._buffer.drain_blocking()
            self._index.file_new_blocking()
        core = self._core
        with core.lock:
            if core.closed:
                raise closed_error(core.kind, core.name, f"read output {output}")
            popped = self._index.pop(output)
            core.held.discard(output)
        return None if popped is None else rows_by_input(*popped)

    def _read_output_blocking(
        self, output: int, read: Callable[[int, np.ndarray], _T]
    ) -> _T | list:
        """Take one output's index rows, then ``read(fd, rows)`` outside the lock,
        counting the bytes and translating I/O errors."""
        rows = self._take_entries(output)
        if rows is None:
            return []
        nbytes = int(rows["nbytes"].sum())
        core = self._core
        with core.lock:
            if core.closed:
                raise closed_error(core.kind, core.name, f"read output {output}")
            core.ledger.bytes_buffered -= nbytes  # discarded now; counted read once read
            core.inflight += 1
            fd = self._file.fd
        assert fd is not None  # entries exist only after the file was written
        try:
            result = read(fd, rows)
        except OSError as exc:
            with core.lock:
                core.release_locked()
            action = f"read {nbytes} bytes of output {output}"
            raise self._file.storage_error(exc, action, _READ_ADVICE) from exc
        except BaseException:
            with core.lock:
                core.release_locked()
            raise
        with core.lock:
            core.ledger.bytes_read += nbytes
            core.release_locked()
        return result

    def _read_stacked_entries_blocking(
        self, fd: int, output: int, rows: np.ndarray, out: np.ndarray, order: list[int]
    ) -> list[int]:
        ranks = _ranks(np.asarray(order, dtype=np.int64), rows["input"])
        rows, ranks = rows[ranks >= 0], ranks[ranks >= 0]
        sorted_rows = rows[np.argsort(ranks, kind="stable")]
        gaps = np.flatnonzero(np.sort(ranks) != np.arange(len(ranks)))
        present = int(gaps[0]) if len(gaps) else len(ranks)  # placed up to the first missing
        sorted_rows = sorted_rows[:present]
        target = out.reshape(-1).view(np.uint8).data
        ends = np.cumsum(sorted_rows["nbytes"])
        if present == len(order) and (not len(ends) or int(ends[-1]) != target.nbytes):
            raise RechunkRunError(
                f"The pieces of output {output} in store {self.name!r} hold "
                f"{int(ends[-1]) if len(ends) else 0} of its {target.nbytes} bytes"
            )
        if len(ends) and int(ends[-1]) > target.nbytes:
            raise RechunkRunError(
                f"The pieces of output {output} in store {self.name!r} overflow its "
                f"{target.nbytes} bytes"
            )
        starts = ends - sorted_rows["nbytes"]
        offsets = sorted_rows["offset"]
        direct = self._file.direct
        if direct is not None:
            stack = np.frombuffer(target, dtype=np.uint8)
            place = _stacking_into(stack, starts, sorted_rows["nbytes"])
            direct.read_blocking(offsets, sorted_rows["nbytes"], place)
            return [order[k] for k in range(present)]
        # a new pread wherever the next piece does not follow the previous one in the file
        breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + sorted_rows["nbytes"][:-1]) + 1
        if len(breaks) and int(ends[-1]) < GATHER_BELOW * (len(breaks) + 1):
            _gather_blocking(fd, offsets, sorted_rows["nbytes"], starts, out)
            return [order[k] for k in range(present)]
        bounds = np.concatenate(([0], breaks, [len(sorted_rows)])).tolist()
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                dst_lo, dst_hi = int(starts[lo]), int(ends[hi - 1])
                preadv_all(fd, [target[dst_lo:dst_hi]], int(offsets[lo]))
        return [order[k] for k in range(present)]

    def _read_into_entries_blocking(
        self,
        fd: int,
        rows: np.ndarray,
        out: np.ndarray,
        placement: Mapping[int, tuple[slice, ...]],
    ) -> None:
        if self._pickled:
            for input_, array in self._read_entries_blocking(fd, rows):
                if input_ in placement:
                    place_blocking(out, placement[input_], array)
            return
        targets: list[tuple[int, memoryview]] = []
        staged: list[tuple[np.ndarray, np.ndarray]] = []
        shapes = self._index.shapes
        for offset, nbytes, input_, shape_id in _columns(rows):
            if not nbytes or input_ not in placement:
                continue
            region = out[placement[input_]]
            shape = shapes[shape_id]
            if region.flags.c_contiguous and region.shape == shape:
                targets.append((offset, region.reshape(-1).view(np.uint8).data))
            else:
                buffer = np.empty(shape, dtype=self.dtype)
                staged.append((region, buffer))
                targets.append((offset, buffer.reshape(-1).view(np.uint8).data))
        self._read_targets_blocking(fd, targets)
        for region, buffer in staged:
            region[...] = buffer

    def _read_targets_blocking(self, fd: int, targets: list[tuple[int, memoryview]]) -> None:
        """Fill each ``(file offset, view)`` target: unbuffered if the store is, else one
        ``preadv`` per run of adjacent ones."""
        direct = self._file.direct
        if direct is None:
            read_targets_blocking(fd, targets)
            return
        views = [view.cast("B") if view.format != "B" else view for _, view in targets]

        def place(stage: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> None:
            for k, at in zip(rows.tolist(), positions.tolist()):
                views[k][:] = stage[at : at + views[k].nbytes]

        offsets = np.array([offset for offset, _ in targets], dtype=np.int64)
        sizes = np.array([view.nbytes for view in views], dtype=np.int64)
        direct.read_blocking(offsets, sizes, place)

    def _read_entries_blocking(self, fd: int, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Allocate one buffer per entry and fill them, coalescing adjacent entries; the
        pairs in the order of ``rows`` (by input)."""
        result: list[tuple[int, np.ndarray]] = []
        raw: list[tuple[int, int, np.ndarray]] = []  # (input, position in result, bytes)
        targets: list[tuple[int, memoryview]] = []
        shapes = self._index.shapes
        for offset, nbytes, input_, shape_id in _columns(rows):
            if self._pickled:
                buffer = np.empty(nbytes, dtype=np.uint8)
                raw.append((input_, len(result), buffer))
                result.append((input_, buffer))
            else:
                array = np.empty(shapes[shape_id], dtype=self.dtype)
                buffer = array.reshape(-1).view(np.uint8)
                result.append((input_, array))
            if nbytes:
                targets.append((offset, buffer.data))
        self._read_targets_blocking(fd, targets)
        for input_, position, buffer in raw:
            result[position] = (input_, owned_array(np.asarray(pickle.loads(buffer.data))))
        return result


def _gather_blocking(
    fd: int, offsets: np.ndarray, sizes: np.ndarray, starts: np.ndarray, out: np.ndarray
) -> None:
    """Fill ``out``'s bytes ``starts[k]:starts[k] + sizes[k]`` from the file's
    ``offsets[k]:`` for every ``k``: one ``pread`` per run of pieces adjacent in the file
    into a staging buffer, then one gather into ``out`` (in units of the dtype's item where
    the sizes allow). For outputs of many small pieces whose order on disk is not theirs in
    the output (pieces that came in different flushes interleave)."""
    by_file = np.argsort(offsets, kind="stable")
    o, s = offsets[by_file], sizes[by_file]
    total = int(s.sum())
    stage = np.empty(total, dtype=np.uint8)
    at = np.cumsum(s) - s  # where each piece lies in the staging buffer, in file order
    runs = np.flatnonzero(o[1:] != o[:-1] + s[:-1]) + 1
    for lo, hi in itertools.pairwise([0, *runs.tolist(), len(o)]):
        first, last = int(at[lo]), int(at[hi - 1] + s[hi - 1])
        preadv_all(fd, [stage[first:last].data], int(o[lo]))
    source = np.empty_like(at)
    source[by_file] = at
    unit = out.dtype.itemsize if out.dtype.itemsize in (1, 2, 4, 8) else 1
    if (sizes % unit).any() or (source % unit).any() or (starts % unit).any():
        unit = 1
    kind = np.dtype(f"u{unit}")
    counts = sizes // unit
    picks = np.arange(total // unit, dtype=np.int64)
    picks += np.repeat((source - starts) // unit, counts)
    flat = out.reshape(-1).view(np.uint8)[:total].view(kind)
    np.take(stage.view(kind), picks, out=flat)


def _ranks(order: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """The position in ``order`` (distinct inputs) of each of ``inputs``; -1 where absent.

    >>> _ranks(np.array([7, 3, 5]), np.array([5, 4, 7])).tolist()
    [2, -1, 0]
    """
    if not len(order):
        return np.full(len(inputs), -1, dtype=np.int64)
    sorter = np.argsort(order, kind="stable")
    at = np.minimum(np.searchsorted(order, inputs, sorter=sorter), len(order) - 1)
    ranks = sorter[at]
    return np.where(order[ranks] == inputs, ranks, -1)


def _columns(rows: np.ndarray) -> Iterable[tuple[int, int, int, int]]:
    """``(offset, nbytes, input, shape id)`` of each index row, as Python ints."""
    return zip(
        rows["offset"].tolist(),
        rows["nbytes"].tolist(),
        rows["input"].tolist(),
        rows["shape"].tolist(),
    )


def _stacking_into(
    target: np.ndarray, starts: np.ndarray, nbytes: np.ndarray
) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """A ``place`` for :meth:`DirectFile.read_blocking` that copies row ``k`` (``nbytes[k]``
    bytes) to ``target[starts[k]:]``: one slice copy per run of rows that follow each other
    in the staging buffer and in ``target`` alike (a flush's pieces of one output lie in
    input order, so runs are long), and no temporary copy."""

    def place(stage: np.ndarray, picked: np.ndarray, positions: np.ndarray) -> None:
        if not len(picked):
            return
        sizes, dst = nbytes[picked], starts[picked]
        ends = positions + sizes
        apart = (positions[1:] != ends[:-1]) | (dst[1:] != dst[:-1] + sizes[:-1])
        bounds = [0, *(np.flatnonzero(apart) + 1).tolist(), len(picked)]
        for lo, hi in itertools.pairwise(bounds):
            src, to, size = int(positions[lo]), int(dst[lo]), int(ends[hi - 1] - positions[lo])
            target[to : to + size] = stage[src : src + size]

    return place
