"""A piece store that spills pieces to one append-only file on local disk.

Where it runs: offload pool and task threads (blocking; never on the event loop).

Layout: a sub-directory of the worker's local directory, named after the store, holding one
data file. Writes gather pieces in a write buffer (``buffer_bytes``); once they are half of
it, they are written in the background (on the process's store I/O pool, one write in flight
a store), ordered by output and input, so that one output's pieces lie one after another,
while writers go on gathering the other half (a writer waits while its pieces would take the
write in flight and the gathered ones past ``buffer_bytes``: at most that is held then, and
under half of it plus one batch when no write is in flight).
A write reserves a contiguous byte range of the file under the lock, then writes with
``os.pwritev`` (per ``IOV_MAX`` buffers) *outside* the lock, so concurrent writers never
serialise on I/O; only then are the pieces published in the index, numpy rows of
:data:`ENTRY`. A read flushes the buffer, takes an output's rows and ``os.preadv``-s straight
into the output or fresh arrays (adjacent byte ranges in one call). Fixed-width dtypes are
stored as raw bytes; dtypes holding Python objects are pickled (protocol 5). Disk space of
discarded outputs is reclaimed only when the store is closed, which removes the file and the
directory. A store may write and read its file unbuffered instead (``direct_io``,
:mod:`rechunk_p2p.store.direct`): every write then starts at an aligned offset.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.store.base import Piece, StoreKind, StoreStatistics, check_piece, closed_error
from rechunk_p2p.store.disk_blocks import ENTRY, Block
from rechunk_p2p.store.disk_buffer import WriteBuffer
from rechunk_p2p.store.disk_parts import (
    DATA_FILE,
    STORE_IO_THREADS,
    PieceIndex,
    SpillFile,
    StoreCore,
)
from rechunk_p2p.store.disk_reads import DiskReads
from rechunk_p2p.store.ledger import pair_keys
from rechunk_p2p.store.reading import read_output_blocking
from rechunk_p2p.transport.wire import (
    Packed,
    in_order,
    output_array,
    packed_sizes,
    unpack_blocking,
)

if TYPE_CHECKING:
    from rechunk_p2p.spec import ShuffleSpec

__all__ = ["DATA_FILE", "STORE_IO_THREADS", "DiskPieceStore"]


class DiskPieceStore:
    """**Thread-safe (guarded by `_core.lock`).** Spills pieces to one file under
    ``directory``; composed of owned parts: what they share (:class:`StoreCore`: the lock,
    whether closed, the I/O in flight, the ledger), the data file (:class:`SpillFile`), the
    index of where each piece lies (:class:`PieceIndex`), the write buffer
    (:class:`~rechunk_p2p.store.disk_buffer.WriteBuffer`) and the reads
    (:class:`~rechunk_p2p.store.disk_reads.DiskReads`).

    ``_core.lock`` is never held during I/O or while the index is sorted;
    :meth:`close_blocking` waits (on ``_core.idle``) until no I/O is in flight before closing
    the file, so a file descriptor is never closed under a reader or writer. The index holds
    no Python object per piece: writes append rows of :data:`ENTRY` (one array per write
    call), and the first read after writes sorts them by output and input once and files
    them under their outputs.

    Parameters
    ----------
    dtype
        The dtype of every piece.
    directory
        Parent directory of the store's own sub-directory, which is named after ``name`` and
        created on the first write (``None``: the system temporary directory). Missing
        parents are created too and removed again at close if still empty.
    name
        Names the store in error messages and on disk.
    buffer_bytes
        Pieces gathered in memory before they are written, ordered by output, so that an
        output is read back in a few large reads instead of one per piece (``0``: each write
        goes to disk at once). They count as held bytes like spilled ones.
    direct_io
        Whether the data file is written and read with ``O_DIRECT``, bypassing the page cache
        (see :mod:`rechunk_p2p.store.direct`): ``True`` where the platform and file system
        allow it, ``False`` never, ``None`` (auto) decided by the first write's mean bytes per
        output (:func:`~rechunk_p2p.store.direct.worth_direct`).
    io_pool
        Runs the background writes and the extents of a read in parallel: the worker's store
        I/O pool, shared by its stores (``None``: a pool of the store's own, made on first
        use and shut down at close).
    """

    kind: StoreKind = "disk"
    copies_pieces = False  # (batches wait in the write buffer as given)
    fills_outputs = False

    def __init__(
        self,
        dtype: np.dtype,
        directory: str | os.PathLike[str] | None,
        name: str,
        buffer_bytes: int = 0,
        direct_io: bool | None = None,
        io_pool: OffloadPool | None = None,
    ) -> None:
        self.dtype = np.dtype(dtype)
        self.name = name
        parent = tempfile.gettempdir() if directory is None else os.fspath(directory)
        self.directory = os.path.abspath(parent)
        self._pickled = self.dtype.hasobject
        self._core = StoreCore(self.kind, name)
        self._file = SpillFile(self.directory, name, direct_io, io_pool)
        self._index = PieceIndex()
        self._buffer = WriteBuffer(
            self._core, self._index, buffer_bytes, self._write_rows_blocking, self._file.io_pool
        )
        self._reads = DiskReads(self._core, self._index, self._file, self._buffer, self.dtype)
        self._close_done = threading.Event()

    def __repr__(self) -> str:
        return f"<DiskPieceStore {self.name!r} dtype={self.dtype} path={self.path!r}>"

    @property
    def path(self) -> str | None:
        """The store's own directory, or ``None`` before the first write."""
        return self._file.path

    # -- writing -----------------------------------------------------------------------

    def write_blocking(self, pieces: Iterable[Piece]) -> int:
        """Spill pieces to disk, dropping ``(output, input)`` pairs already stored.

        See :meth:`rechunk_p2p.store.base.PieceStore.write_blocking`. Returns the bytes
        spilled (the pickled size for object dtypes).
        """
        checked = [check_piece(s, self.dtype, self.kind, self.name) for s in pieces]
        checked.sort(key=lambda s: (s[0], s[1]))  # one output's pieces end up adjacent
        views = [self._encode(a) for _, _, a in checked]
        return self._append_blocking(
            [o for o, _, _ in checked],
            [i for _, i, _ in checked],
            [a.shape for _, _, a in checked],
            views,
            [v.nbytes for v in views],
        )

    def write_packed_blocking(self, batch: Iterable[Packed]) -> int:
        """Spill batches of pieces as they came off the wire: each batch's payload is
        written as it is, with one index row per piece and no per-piece buffer. Dropping
        pairs already stored as :meth:`write_blocking` does; returns the bytes spilled."""
        if self._pickled:
            return self.write_blocking(s for p in batch for s in unpack_blocking(p, self.dtype))
        total = 0
        for packed in batch:
            packed = in_order(packed, self.dtype)  # (pieces one after another, as filed)
            sizes = packed_sizes(packed, self.dtype)
            if self._buffer.buffer_bytes > 0 and packed.regular:
                total += self._append_block_blocking(packed, int(sizes[0]))
                continue
            total += self._append_blocking(
                list(packed.outputs), list(packed.inputs), packed.shapes, [packed.payload], sizes
            )
        return total

    def _append_blocking(
        self,
        outputs: list[int],
        inputs: list[int],
        shapes: Sequence[tuple[int, ...]],
        payloads: list,
        sizes: Sequence[int] | np.ndarray,
    ) -> int:
        """Store pieces: write them to the data file now, or gather them in the write buffer
        until it is full. ``payloads`` hold the pieces' bytes one after another (one buffer
        per piece, or one buffer holding them all); ``sizes`` are their byte counts."""
        if not outputs:
            return 0
        core = self._core
        with core.lock:
            if core.closed:
                raise closed_error(self.kind, self.name, "write pieces")
            admitted = core.ledger.admit_keys(pair_keys(outputs, inputs))
        shape_ids = self._index.shape_ids(shapes)
        rows = np.empty(len(outputs), dtype=ENTRY)
        rows["output"], rows["input"], rows["nbytes"] = outputs, inputs, sizes
        rows["shape"], rows["group"] = shape_ids, -1
        if admitted is not None:  # some were stored before: write the others only
            keep = np.asarray(admitted, dtype=bool)
            payloads = _split_kept(payloads, np.asarray(sizes, dtype=np.int64), keep)
            rows = rows[keep]
        total = int(rows["nbytes"].sum())
        if not len(rows):
            return 0
        if self._buffer.buffer_bytes <= 0:
            self._write_rows_blocking(rows, [memoryview(p).cast("B") for p in payloads])
            with core.lock:
                # closed while writing: accepted, and dropped by the close (nothing held)
                if not core.closed:
                    core.held.update(rows["output"].tolist())
                core.ledger.stored(len(rows), total, held=not core.closed)
            return total
        views = _piece_views(payloads, rows["nbytes"])
        return self._buffer.gather_blocking(
            (rows, views), rows["output"], total, lambda: pair_keys(rows["output"], rows["input"])
        )

    def _append_block_blocking(self, packed: Packed, size: int) -> int:
        """Gather a regular batch (pieces of ``size`` bytes) whole, as one
        :class:`~rechunk_p2p.store.disk_blocks.Block`: no index row or view per piece."""
        outputs = output_array(packed)
        input_ = packed.inputs[0]
        core = self._core
        with core.lock:
            if core.closed:
                raise closed_error(self.kind, self.name, "write pieces")
            admitted = core.ledger.admit_batch(input_, outputs)
        (shape_id,) = self._index.shape_ids_list(packed.shapes[:1])
        payload = packed.payload.reshape(-1).view(np.uint8)
        if admitted is not None:  # some were stored before: keep the others only
            payload = payload.reshape(len(outputs), size)[admitted].reshape(-1)
            outputs = outputs[admitted]
        if not len(outputs):
            return 0
        block = Block(outputs, input_, int(shape_id), size, payload)
        return self._buffer.gather_blocking(
            block, outputs, block.nbytes, lambda: pair_keys(outputs, input_)
        )

    def _write_rows_blocking(
        self,
        rows: np.ndarray,
        views: list[memoryview],
        pairs: Callable[[], np.ndarray] | None = None,
    ) -> None:
        """Write ``views`` (the bytes of ``rows``, in order) at the end of the data file, then
        publish the rows with their offsets. ``pairs``: the pair keys of the pieces, where
        the rows are not one a piece."""
        if pairs is None:
            pairs = functools.partial(pair_keys, rows["output"], rows["input"])
        total = int(rows["nbytes"].sum())
        core = self._core
        with core.lock:
            if core.closed:
                core.ledger.forget_keys(pairs())
                raise closed_error(self.kind, self.name, "write pieces")
            core.inflight += 1
        start = self._file.reserve(total, len(np.unique(rows["output"])))
        rows["offset"] = start + np.cumsum(rows["nbytes"]) - rows["nbytes"]
        try:
            fd = self._file.ensure_blocking()
            self._file.write_at_blocking(fd, views, start)
        except OSError as exc:
            with core.lock:
                core.ledger.forget_keys(pairs())
                core.release_locked()
            raise self._file.storage_error(exc, f"write {total} bytes of pieces") from exc
        self._index.publish(rows)
        with core.lock:
            core.release_locked()

    def _encode(self, array: np.ndarray) -> memoryview:
        """Return the bytes to spill for one array (no copy if it is C-contiguous)."""
        if self._pickled:
            return memoryview(pickle.dumps(np.asarray(array), protocol=5))
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)  # never 0-d here: 0-d is always contiguous
        return array.reshape(-1).view(np.uint8).data

    # -- reading -----------------------------------------------------------------------

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """See :meth:`rechunk_p2p.store.disk_reads.DiskReads.read_blocking`."""
        return self._reads.read_blocking(output)

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """See :meth:`rechunk_p2p.store.disk_reads.DiskReads.read_into_blocking`."""
        return self._reads.read_into_blocking(output, out, placement)

    def read_stacked_blocking(self, output: int, out: np.ndarray, order: list[int]) -> list[int]:
        """See :meth:`rechunk_p2p.store.disk_reads.DiskReads.read_stacked_blocking`."""
        return self._reads.read_stacked_blocking(output, out, order)

    def assemble_blocking(self, spec: ShuffleSpec, output: int) -> tuple[np.ndarray, list[int]]:
        """See :meth:`rechunk_p2p.store.base.PieceStore.assemble_blocking` (its pieces
        read back into a new array)."""
        return read_output_blocking(self, spec, output)

    # -- lifecycle ---------------------------------------------------------------------

    def close_blocking(self) -> None:
        """Wait for I/O in flight, then close and remove the data file and directory.

        Idempotent; a concurrent second call returns once the first has finished.

        Raises
        ------
        RechunkStorageError
            The directory could not be removed (it is left behind).
        """
        core = self._core
        with core.lock:
            first = not core.closed
            core.closed = True
            while core.inflight:
                core.idle.wait()
            self._index.clear()
            self._buffer.clear_locked()
            core.held.clear()
            core.ledger.clear()
        if not first:
            self._close_done.wait()
            return
        try:
            self._file.close_blocking()
        except OSError as exc:
            advice = "Remove that directory by hand once no worker uses it."
            raise self._file.storage_error(exc, "remove the spilled pieces", advice) from exc
        finally:
            self._close_done.set()

    def spill_blocking(self) -> int:
        """Nothing to move: every piece is on disk (or in the write buffer, bounded)."""
        return 0

    def forget_outputs_blocking(self, outputs: Iterable[int]) -> None:
        """Forget that ``outputs`` (read already) got their pieces: they are assembled
        again from pieces sent anew."""
        with self._core.lock:
            self._core.ledger.forget_outputs(outputs)

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        with self._core.lock:
            return self._core.ledger.statistics(self.kind, outputs=len(self._core.held))


# -- plain helpers (blocking) ----------------------------------------------------------


def _split_kept(payloads: list, sizes: np.ndarray, keep: np.ndarray) -> list[memoryview]:
    """The bytes of the kept pieces of ``payloads`` (see :func:`_piece_views`), in order."""
    return [v for v, k in zip(_piece_views(payloads, sizes), keep.tolist()) if k]


def _piece_views(payloads: list, sizes: np.ndarray) -> list[memoryview]:
    """One memoryview per piece of ``payloads`` (one buffer per piece, or one holding all
    of them one after another, ``sizes`` bytes each)."""
    flat = [memoryview(p).cast("B") for p in payloads]
    if len(flat) == len(sizes):
        return flat
    (whole,) = flat
    ends = np.cumsum(sizes).tolist()
    return [whole[a:b] for a, b in zip([0, *ends[:-1]], ends)]
