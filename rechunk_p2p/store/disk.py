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

import errno
import functools
import os
import pickle
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rechunk_p2p.errors import RechunkStorageError
from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.store.base import (
    Piece,
    StoreKind,
    StoreStatistics,
    check_piece,
    closed_error,
)
from rechunk_p2p.store.direct import (
    DirectFile,
    aligned_up,
    open_direct,
    worth_direct,
)
from rechunk_p2p.store.disk_blocks import (
    ENTRY,
    Block,
    Group,
)
from rechunk_p2p.store.disk_buffer import DiskWriteBuffer, Pending
from rechunk_p2p.store.disk_reads import DiskReads
from rechunk_p2p.store.files import (
    make_store_directory,
    pwritev_all,
    remove_blocking,
    safe_name,
)
from rechunk_p2p.store.ledger import PieceLedger, pair_keys
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

DATA_FILE = "pieces.bin"

_WRITE_ADVICE = (
    "Free space on that disk, point the worker's local directory elsewhere "
    "(`dask worker --local-directory ...` or the `temporary-directory` config), or "
    'buffer pieces in memory with dask.config.set({"rechunk-p2p.storage": "memory"}).'
)


#: Threads of a worker's store I/O pool: a read runs up to
#: :data:`~rechunk_p2p.store.direct.READS_IN_FLIGHT` extents at once, and each store has one
#: background write in flight; the rest let two stores write beside a read.
STORE_IO_THREADS = 6


class DiskPieceStore(DiskWriteBuffer, DiskReads):
    """**Thread-safe (guarded by `_lock`).** Spills pieces to one file under ``directory``.

    ``_lock`` guards the index, the reserved end of the file, the counters, the set of
    stored ``(output, input)`` pairs and the number of I/O operations in flight; it is never
    held during I/O or while the index is sorted. ``_create_lock`` only serialises the
    one-time creation of the directory and the data file on the first write; ``_sort_lock``
    lets one reader at a time sort what was written since the last read. :meth:`close_blocking`
    waits (on ``_idle``, a condition of ``_lock``) until no I/O is in flight before closing
    the file, so a file descriptor is never closed under a reader or writer.

    The index holds no Python object per piece: writes append rows of :data:`ENTRY` (one
    array per write call), and the first read after writes sorts them by output and input
    once and files them under their outputs.

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
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._create_lock = threading.Lock()
        self._sort_lock = threading.Lock()
        self._closed = False
        self._close_done = threading.Event()
        self._inflight = 0
        self._shared_io = io_pool
        self._own_io: OffloadPool | None = None
        self._end = 0
        self._buffer_bytes = int(buffer_bytes)
        self._pending: list[Pending] = []  # not written yet
        self._pending_bytes = 0
        self._flushing = 0  # bytes of the background write in flight
        self._flush_error: BaseException | None = None
        self._unsorted: list[np.ndarray] = []  # ENTRY rows written since the last sort
        self._index: dict[int, list[np.ndarray]] = {}  # output -> sorted ENTRY rows
        self._groups: list[Group] = []  # the groups that ENTRY rows name (disk_blocks)
        self._held: set[int] = set()  # outputs with spilled pieces not read yet
        self._shapes: list[tuple[int, ...]] = []
        self._shape_ids: dict[tuple[int, ...], int] = {}
        self._ledger = PieceLedger()
        self._fd: int | None = None
        self._direct_io = direct_io  # None until the first write decides (auto)
        self._direct: DirectFile | None = None  # once the file is open unbuffered too
        self._direct_file: DirectFile | None = None  # the same, kept after a fallback
        self._path: str | None = None
        self._finalizer: weakref.finalize | None = None

    def __repr__(self) -> str:
        return f"<DiskPieceStore {self.name!r} dtype={self.dtype} path={self.path!r}>"

    @property
    def path(self) -> str | None:
        """The store's own directory, or ``None`` before the first write."""
        return self._path

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
            if self._buffer_bytes > 0 and packed.regular:
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
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write pieces")
            admitted = self._ledger.admit_keys(pair_keys(outputs, inputs))
            shape_ids = self._shape_ids_locked(shapes)
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
        if self._buffer_bytes <= 0:
            self._write_rows_blocking(rows, [memoryview(p).cast("B") for p in payloads])
            with self._lock:
                # closed while writing: accepted, and dropped by the close (nothing held)
                if not self._closed:
                    self._held.update(rows["output"].tolist())
                self._ledger.stored(len(rows), total, held=not self._closed)
            return total
        views = _piece_views(payloads, rows["nbytes"])
        return self._gather_blocking(
            (rows, views), rows["output"], total, lambda: pair_keys(rows["output"], rows["input"])
        )

    def _append_block_blocking(self, packed: Packed, size: int) -> int:
        """Gather a regular batch (pieces of ``size`` bytes) whole, as one
        :class:`~rechunk_p2p.store.disk_blocks.Block`: no index row or view per piece."""
        outputs = output_array(packed)
        input_ = packed.inputs[0]
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write pieces")
            admitted = self._ledger.admit_batch(input_, outputs)
            (shape_id,) = self._shape_ids_list_locked(packed.shapes[:1])
        payload = packed.payload.reshape(-1).view(np.uint8)
        if admitted is not None:  # some were stored before: keep the others only
            payload = payload.reshape(len(outputs), size)[admitted].reshape(-1)
            outputs = outputs[admitted]
        if not len(outputs):
            return 0
        block = Block(outputs, input_, int(shape_id), size, payload)
        return self._gather_blocking(
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
        with self._lock:
            if self._closed:
                self._ledger.forget_keys(pairs())
                raise closed_error(self.kind, self.name, "write pieces")
            if self._direct_io is None:
                self._direct_io = worth_direct(total, len(np.unique(rows["output"])))
            start = self._end
            # unbuffered writes start at aligned offsets (the last block padded)
            self._end += aligned_up(total) if self._direct_io else total
            self._inflight += 1
        rows["offset"] = start + np.cumsum(rows["nbytes"]) - rows["nbytes"]
        try:
            fd = self._ensure_file_blocking()
            self._write_at_blocking(fd, views, start)
        except OSError as exc:
            with self._lock:
                self._ledger.forget_keys(pairs())
                self._release_locked()
            raise self._storage_error(exc, f"write {total} bytes of pieces") from exc
        with self._lock:
            self._unsorted.append(rows)
            self._release_locked()

    def _write_at_blocking(self, fd: int, views: list[memoryview], start: int) -> None:
        """Write ``views`` at ``start``: unbuffered if the store is, falling back to the
        page cache for good if the file system turns out to refuse it (``EINVAL``)."""
        direct = self._direct
        if direct is not None:
            try:
                direct.write_blocking(views, start)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                with self._lock:
                    self._direct = None  # reads of what was written work either way
        pwritev_all(fd, views, start)

    def _shape_ids_locked(self, shapes: Sequence[tuple[int, ...]]) -> list[int] | int:
        """Ids of ``shapes`` in the store's table of shapes (one id when they are all one)."""
        if shapes and all(s == shapes[0] for s in shapes):
            return self._shape_ids_list_locked(shapes[:1])[0]
        return self._shape_ids_list_locked(shapes)

    def _shape_ids_list_locked(self, shapes: Sequence[tuple[int, ...]]) -> list[int]:
        """The id of each of ``shapes`` in the store's table of shapes."""
        ids = []
        for shape in shapes:
            shape = tuple(shape)
            if shape not in self._shape_ids:
                self._shape_ids[shape] = len(self._shapes)
                self._shapes.append(shape)
            ids.append(self._shape_ids[shape])
        return ids

    def _encode(self, array: np.ndarray) -> memoryview:
        """Return the bytes to spill for one array (no copy if it is C-contiguous)."""
        if self._pickled:
            return memoryview(pickle.dumps(np.asarray(array), protocol=5))
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)  # never 0-d here: 0-d is always contiguous
        return array.reshape(-1).view(np.uint8).data

    def _ensure_file_blocking(self) -> int:
        """Create the directory and the data file on first use; return its descriptor."""
        fd = self._fd
        if fd is not None:
            return fd
        with self._create_lock:
            if self._fd is None:
                created: list[str] = []
                path, fd = None, None
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                try:
                    path = make_store_directory(self.directory, safe_name(self.name), created)
                    data_file = os.path.join(path, DATA_FILE)
                    fd = os.open(data_file, flags, 0o600)
                    direct_fd = open_direct(data_file) if self._direct_io else None
                except OSError:
                    remove_blocking((fd,) if fd is not None else (), path, created)
                    raise
                fds = (fd,) if direct_fd is None else (fd, direct_fd)
                self._path = path
                self._finalizer = weakref.finalize(self, remove_blocking, fds, path, created)
                if direct_fd is not None:
                    self._direct = self._direct_file = DirectFile(direct_fd, self._io_pool())
                self._fd = fd
            return self._fd

    # -- lifecycle ---------------------------------------------------------------------

    def _io_pool(self) -> OffloadPool:
        """The pool of the background writes and parallel reads (see ``io_pool``)."""
        if self._shared_io is not None:
            return self._shared_io
        with self._lock:
            if self._own_io is None:
                self._own_io = OffloadPool(STORE_IO_THREADS, "rechunk-p2p-store-io")
            return self._own_io

    def _release_locked(self) -> None:
        """End one I/O operation; wake :meth:`close_blocking` if none is left. Hold `_lock`."""
        self._inflight -= 1
        if not self._inflight:
            self._idle.notify_all()

    def close_blocking(self) -> None:
        """Wait for I/O in flight, then close and remove the data file and directory.

        Idempotent; a concurrent second call returns once the first has finished.

        Raises
        ------
        RechunkStorageError
            The directory could not be removed (it is left behind).
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            while self._inflight:
                self._idle.wait()
            self._index.clear()
            self._groups.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self._unsorted.clear()
            self._held.clear()
            self._ledger.clear()
            direct = self._direct_file
            own, self._own_io = self._own_io, None
        if own is not None:
            own.shutdown(wait=True)  # its last write is done (nothing in flight)
        if direct is not None:
            direct.close_blocking()
        if not first:
            self._close_done.wait()
            return
        try:
            if self._finalizer is not None:
                self._finalizer()
        except OSError as exc:
            advice = "Remove that directory by hand once no worker uses it."
            raise self._storage_error(exc, "remove the spilled pieces", advice) from exc
        finally:
            self._close_done.set()

    def assemble_blocking(self, spec: ShuffleSpec, output: int) -> tuple[np.ndarray, list[int]]:
        """See :meth:`rechunk_p2p.store.base.PieceStore.assemble_blocking` (its pieces
        read back into a new array)."""
        return read_output_blocking(self, spec, output)

    def spill_blocking(self) -> int:
        """Nothing to move: every piece is on disk (or in the write buffer, bounded)."""
        return 0

    def forget_outputs_blocking(self, outputs: Iterable[int]) -> None:
        """Forget that ``outputs`` (read already) got their pieces: they are assembled
        again from pieces sent anew."""
        with self._lock:
            self._ledger.forget_outputs(outputs)

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        with self._lock:
            return self._ledger.statistics(self.kind, outputs=len(self._held))

    def _storage_error(self, exc: OSError, action: str, advice: str = "") -> RechunkStorageError:
        """Translate an ``OSError`` into an actionable :class:`RechunkStorageError`."""
        where = self._path or os.path.join(self.directory, safe_name(self.name))
        reason = exc.strerror or str(exc) or type(exc).__name__
        message = (
            f"The disk piece store {self.name!r} could not {action} in {where!r}: {reason}. "
            + (advice or _WRITE_ADVICE)
        )
        if exc.errno is not None:
            return RechunkStorageError(exc.errno, message)
        return RechunkStorageError(message)


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
