"""The parts a disk store is made of: what they share (:class:`StoreCore`), its data file
(:class:`SpillFile`) and the index of where each piece lies in it (:class:`PieceIndex`).

Where it runs: task threads, the offload pool and the store I/O pool (blocking; never on the
event loop). The write buffer (:mod:`rechunk_p2p.store.disk_buffer`) and the reads
(:mod:`rechunk_p2p.store.disk_reads`) are parts too; :class:`~rechunk_p2p.store.disk.
DiskPieceStore` composes them.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from rechunk_p2p.errors import RechunkStorageError
from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.store.direct import DirectFile, aligned_up, open_direct, worth_direct
from rechunk_p2p.store.disk_blocks import Group, expand_rows
from rechunk_p2p.store.files import (
    make_store_directory,
    pwritev_all,
    remove_blocking,
    safe_name,
)
from rechunk_p2p.store.ledger import PieceLedger

DATA_FILE = "pieces.bin"

#: Threads of a worker's store I/O pool: a read runs up to
#: :data:`~rechunk_p2p.store.direct.READS_IN_FLIGHT` extents at once, and each store has one
#: background write in flight; the rest let two stores write beside a read.
STORE_IO_THREADS = 6

WRITE_ADVICE = (
    "Free space on that disk, point the worker's local directory elsewhere "
    "(`dask worker --local-directory ...` or the `temporary-directory` config), or "
    'buffer pieces in memory with dask.config.set({"rechunk-p2p.storage": "memory"}).'
)


class StoreCore:
    """**Thread-safe (guarded by `lock`).** What the parts of one disk store share: the
    lock and its condition ``idle`` (notified as I/O ends and room frees in the write
    buffer), whether the store is closed, the I/O operations in flight (a close waits for
    none), the ledger of pieces stored and read, and the outputs with pieces not read yet
    (``held``). ``lock`` is never held during I/O."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.closed = False
        self.inflight = 0
        self.ledger = PieceLedger()
        self.held: set[int] = set()

    def release_locked(self) -> None:
        """End one I/O operation; wake a close waiting for none to be left. Hold `lock`."""
        self.inflight -= 1
        if not self.inflight:
            self.idle.notify_all()


class SpillFile:
    """**Thread-safe (guarded by `_lock`).** A disk store's one data file, under its own
    directory in ``directory``: created on the first write, written at byte ranges reserved
    one after another (aligned ones when unbuffered), removed with the directory at close.

    ``direct_io``: ``True``, ``False``, or ``None`` (decided by the first write, see
    :func:`~rechunk_p2p.store.direct.worth_direct`). ``io_pool``: the worker's store I/O pool
    (``None``: one of the file's own, made on first use and shut down at close).
    """

    def __init__(
        self, directory: str, name: str, direct_io: bool | None, io_pool: OffloadPool | None
    ) -> None:
        self.directory = directory
        self.name = name
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()  # the one-time creation on the first write
        self._end = 0
        self._direct_io = direct_io  # None until the first write decides (auto)
        self.direct: DirectFile | None = None  # while the file is written unbuffered
        self._direct_file: DirectFile | None = None  # the same, kept after a fallback
        self.fd: int | None = None
        self.path: str | None = None  # the store's own directory, once made
        self._finalizer: weakref.finalize | None = None
        self._shared_io = io_pool
        self._own_io: OffloadPool | None = None

    @property
    def end(self) -> int:
        """Bytes of the file reserved so far."""
        with self._lock:
            return self._end

    def reserve(self, nbytes: int, outputs: int) -> int:
        """Reserve ``nbytes`` at the end of the file for a write of ``outputs`` outputs'
        pieces; where it starts. The first write decides whether the file is unbuffered."""
        with self._lock:
            if self._direct_io is None:
                self._direct_io = worth_direct(nbytes, outputs)
            start = self._end
            # unbuffered writes start at aligned offsets (the last block padded)
            self._end += aligned_up(nbytes) if self._direct_io else nbytes
            return start

    def ensure_blocking(self) -> int:
        """Create the directory and the data file on first use; return its descriptor."""
        fd = self.fd
        if fd is not None:
            return fd
        with self._create_lock:
            if self.fd is None:
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
                self.path = path
                self._finalizer = weakref.finalize(self, remove_blocking, fds, path, created)
                if direct_fd is not None:
                    self.direct = self._direct_file = DirectFile(direct_fd, self.io_pool())
                self.fd = fd
            return self.fd

    def write_at_blocking(self, fd: int, views: list[memoryview], start: int) -> None:
        """Write ``views`` at ``start``: unbuffered if the file is, falling back to the page
        cache for good if the file system turns out to refuse it (``EINVAL``)."""
        direct = self.direct
        if direct is not None:
            try:
                direct.write_blocking(views, start)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = None  # reads of what was written work either way
        pwritev_all(fd, views, start)

    def io_pool(self) -> OffloadPool:
        """The pool of the background writes and parallel reads (see ``io_pool``)."""
        if self._shared_io is not None:
            return self._shared_io
        with self._lock:
            if self._own_io is None:
                self._own_io = OffloadPool(STORE_IO_THREADS, "rechunk-p2p-store-io")
            return self._own_io

    def close_blocking(self) -> None:
        """No I/O is in flight: stop the file's own pool, close the file and remove it with
        its directory (raises the ``OSError`` of a directory left behind)."""
        with self._lock:
            own, self._own_io = self._own_io, None
        if own is not None:
            own.shutdown(wait=True)  # its last write is done (nothing in flight)
        if self._direct_file is not None:
            self._direct_file.close_blocking()
        if self._finalizer is not None:
            self._finalizer()

    def storage_error(
        self, exc: OSError, action: str, advice: str = WRITE_ADVICE
    ) -> RechunkStorageError:
        """Translate an ``OSError`` into an actionable :class:`RechunkStorageError`."""
        where = self.path or os.path.join(self.directory, safe_name(self.name))
        reason = exc.strerror or str(exc) or type(exc).__name__
        message = f"The disk piece store {self.name!r} could not {action} in {where!r}: {reason}. "
        if exc.errno is not None:
            return RechunkStorageError(exc.errno, message + advice)
        return RechunkStorageError(message + advice)


class PieceIndex:
    """**Thread-safe (guarded by `_lock`).** Where each piece of a disk store lies in its
    file, as rows of :data:`~rechunk_p2p.store.disk_blocks.ENTRY` (no Python object per
    piece): rows of each write are published as they are (``publish``), and filed by output
    and input (``file_new_blocking``, one reader at a time: ``sorting``) before an output's
    rows are taken. Regular batches are indexed a row per output of a group
    (:mod:`rechunk_p2p.store.disk_blocks`); pieces' shapes are ids into one table.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sorting = threading.Lock()  # one reader at a time files what is new
        self._unsorted: list[np.ndarray] = []  # ENTRY rows written since the last filing
        self._index: dict[int, list[np.ndarray]] = {}  # output -> rows sorted by input
        self._groups: list[Group] = []
        self._shapes: list[tuple[int, ...]] = []
        self._shape_ids: dict[tuple[int, ...], int] = {}

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The table of shapes (append-only: a reader may keep it)."""
        return self._shapes

    def rows(self) -> int:
        """Index rows filed (for tests and statistics)."""
        with self._lock:
            return sum(len(rows) for parts in self._index.values() for rows in parts)

    def shape_ids(self, shapes: Sequence[tuple[int, ...]]) -> list[int] | int:
        """Ids of ``shapes`` in the table (one id when they are all one)."""
        if shapes and all(s == shapes[0] for s in shapes):
            return self.shape_ids_list(shapes[:1])[0]
        return self.shape_ids_list(shapes)

    def shape_ids_list(self, shapes: Sequence[tuple[int, ...]]) -> list[int]:
        """The id of each of ``shapes`` in the table."""
        ids = []
        with self._lock:
            for shape in shapes:
                shape = tuple(shape)
                if shape not in self._shape_ids:
                    self._shape_ids[shape] = len(self._shapes)
                    self._shapes.append(shape)
                ids.append(self._shape_ids[shape])
        return ids

    def add_group(self, group: Group) -> int:
        """Number ``group`` (rows name it by this id)."""
        with self._lock:
            self._groups.append(group)
            return len(self._groups) - 1

    def publish(self, rows: np.ndarray) -> None:
        """Rows of pieces now in the file."""
        with self._lock:
            self._unsorted.append(rows)

    def file_new_blocking(self) -> None:
        """File the rows published since the last filing under their outputs, sorted by
        input (the sort outside the lock). Hold ``sorting``."""
        with self._lock:
            unsorted, self._unsorted = self._unsorted, []
        if not unsorted:
            return
        filed = _file_by_output(np.concatenate(unsorted))
        with self._lock:
            for out, rows in filed:
                self._index.setdefault(out, []).append(rows)

    def pop(self, output: int) -> tuple[list[np.ndarray], list[Group]] | None:
        """Remove ``output``'s rows (:func:`rows_by_input` sorts them); ``None``: it has
        none."""
        with self._lock:
            parts = self._index.pop(output, None)
            return (parts, self._groups) if parts else None

    def clear(self) -> None:
        with self._lock:
            self._unsorted.clear()
            self._index.clear()
            self._groups.clear()


def rows_by_input(parts: list[np.ndarray], groups: list[Group]) -> np.ndarray:
    """An output's rows as :meth:`PieceIndex.pop` gave them: one a piece, sorted by input."""
    rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if len(parts) == 1 and not (rows["group"] >= 0).any():
        return rows  # filed sorted by input
    rows = expand_rows(rows, groups)
    return rows[np.argsort(rows["input"], kind="stable")]


def _file_by_output(rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``rows`` grouped by output, each group sorted by input: ``(output, rows)`` pairs."""
    rows = rows[np.lexsort((rows["input"], rows["output"]))]
    outputs = rows["output"]
    cuts = np.flatnonzero(outputs[1:] != outputs[:-1]) + 1
    bounds = np.concatenate(([0], cuts, [len(rows)])).tolist()
    return [(int(outputs[lo]), rows[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
