"""A shard store that spills shards to one append-only file on local disk.

Where it runs: offload pool and task threads (blocking; never on the event loop).

Layout: a sub-directory of the worker's local directory, named after the store, holding one
data file. A write call reserves a contiguous byte range of the file under the lock, then
writes all of its shards with one ``os.pwritev`` (per ``IOV_MAX`` buffers) *outside* the
lock, so concurrent writers never serialise on I/O; only then are the shards published in an
in-memory index ``output -> [(offset, nbytes, input, shape)]``. A read takes an output's
index entries under the lock and ``os.preadv``-s straight into fresh arrays (adjacent
entries in one call). Fixed-width dtypes are stored as raw bytes; dtypes holding Python
objects are pickled (protocol 5). Disk space of discarded outputs is reclaimed only when the
store is closed, which removes the file and the directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from rechunk_p2p.buffers.base import (
    Shard,
    ShardLedger,
    StoreStatistics,
    check_shard,
    closed_error,
    owned_array,
    place_blocking,
)
from rechunk_p2p.errors import RechunkStorageError

DATA_FILE = "shards.bin"

try:
    _IOV_MAX = max(1, min(int(os.sysconf("SC_IOV_MAX")), 1024))
except (AttributeError, ValueError, OSError):  # pragma: no cover - platform dependent
    _IOV_MAX = 16

_WRITE_ADVICE = (
    "Free space on that disk, point the worker's local directory elsewhere "
    "(`dask worker --local-directory ...` or the `temporary-directory` config), or "
    'buffer shards in memory with dask.config.set({"rechunk-p2p.storage": "memory"}).'
)
_READ_ADVICE = (
    "The spilled data was removed or truncated by something else, or the disk failed; "
    "check the worker's local directory, or buffer shards in memory with "
    'dask.config.set({"rechunk-p2p.storage": "memory"}).'
)

# (offset, nbytes, input index, shape)
_Entry = tuple[int, int, int, tuple[int, ...]]
_T = TypeVar("_T")


class DiskShardStore:
    """**Thread-safe (guarded by `_lock`).** Spills shards to one file under ``directory``.

    ``_lock`` guards the index, the reserved end of the file, the counters, the set of
    stored ``(output, input)`` pairs and the number of I/O operations in flight; it is never
    held during I/O. ``_create_lock`` only serialises the one-time creation of the directory
    and the data file on the first write. :meth:`close_blocking` waits (on ``_idle``, a
    condition of ``_lock``) until no I/O is in flight before closing the file, so a file
    descriptor is never closed under a reader or writer.

    Parameters
    ----------
    dtype
        The dtype of every shard.
    directory
        Parent directory of the store's own sub-directory, which is named after ``name`` and
        created on the first write (``None``: the system temporary directory). Missing
        parents are created too and removed again at close if still empty.
    name
        Names the store in error messages and on disk.
    """

    kind = "disk"

    def __init__(
        self, dtype: np.dtype, directory: str | os.PathLike[str] | None, name: str
    ) -> None:
        self.dtype = np.dtype(dtype)
        self.name = name
        parent = tempfile.gettempdir() if directory is None else os.fspath(directory)
        self.directory = os.path.abspath(parent)
        self._pickled = self.dtype.hasobject
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._create_lock = threading.Lock()
        self._closed = False
        self._close_done = threading.Event()
        self._inflight = 0
        self._end = 0
        self._index: dict[int, list[_Entry]] = {}
        self._ledger = ShardLedger()
        self._fd: int | None = None
        self._path: str | None = None
        self._finalizer: weakref.finalize | None = None

    def __repr__(self) -> str:
        return f"<DiskShardStore {self.name!r} dtype={self.dtype} path={self.path!r}>"

    @property
    def path(self) -> str | None:
        """The store's own directory, or ``None`` before the first write."""
        return self._path

    # -- writing -----------------------------------------------------------------------

    def write_blocking(self, shards: Iterable[Shard]) -> int:
        """Spill shards to disk, dropping ``(output, input)`` pairs already stored.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.write_blocking`. Returns the bytes
        spilled (the pickled size for object dtypes).
        """
        checked = [check_shard(s, self.dtype, self.kind, self.name) for s in shards]
        checked.sort(key=lambda s: (s[0], s[1]))  # one output's shards end up adjacent
        encoded = [(o, i, a.shape, self._encode(a)) for o, i, a in checked]
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write shards")
            accepted = [item for item in encoded if self._ledger.admit(item[0], item[1])]
            total = sum(view.nbytes for *_, view in accepted)
            if not accepted:
                return 0
            start = self._end
            self._end += total
            self._inflight += 1
        entries: list[tuple[int, _Entry]] = []
        offset = start
        for output, input_, shape, view in accepted:
            entries.append((output, (offset, view.nbytes, input_, shape)))
            offset += view.nbytes
        try:
            fd = self._ensure_file_blocking()
            pwritev_all(fd, [view for *_, view in accepted], start)
        except OSError as exc:
            with self._lock:
                self._ledger.forget((o, i) for o, i, *_ in accepted)
                self._release_locked()
            raise self._storage_error(exc, f"write {total} bytes of shards") from exc
        with self._lock:
            for output, entry in entries:
                self._index.setdefault(output, []).append(entry)
            self._ledger.stored(len(entries), total)
            self._release_locked()
        return total

    def _encode(self, array: np.ndarray) -> memoryview:
        """Return the bytes to spill for one array (no copy if it is C-contiguous)."""
        if self._pickled:
            return memoryview(pickle.dumps(np.asarray(array), protocol=5))
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)  # never 0-d here: 0-d is always contiguous
        return memoryview(array.reshape(-1).view(np.uint8))

    def _ensure_file_blocking(self) -> int:
        """Create the directory and the data file on first use; return its descriptor."""
        fd = self._fd
        if fd is not None:
            return fd
        with self._create_lock:
            if self._fd is None:
                created: list[str] = []
                path = None
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                try:
                    path = _make_store_directory(self.directory, _safe_name(self.name), created)
                    fd = os.open(os.path.join(path, DATA_FILE), flags, 0o600)
                except OSError:
                    _remove_blocking(None, path, created)
                    raise
                self._path = path
                self._finalizer = weakref.finalize(self, _remove_blocking, fd, path, created)
                self._fd = fd
            return self._fd

    # -- reading -----------------------------------------------------------------------

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """Read one output's shards back from disk, sorted by input index.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.read_blocking`. Each array is read
        straight into its own freshly allocated buffer.
        """
        result = self._read_output_blocking(output, self._read_entries_blocking)
        result.sort(key=lambda pair: pair[0])
        return result

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """Read each shard of ``output`` straight into ``out[placement[input]]``; discard it.

        Where the target region of ``out`` is contiguous (e.g. a slab along the first axis),
        ``preadv`` fills it directly: no buffer per shard and no second copy. Returns the
        input indices placed.
        """

        def read(fd: int, entries: list[_Entry]) -> list[int]:
            self._read_into_entries_blocking(fd, entries, out, placement)
            return [e[2] for e in entries]

        return self._read_output_blocking(output, read)

    def _read_output_blocking(
        self, output: int, read: Callable[[int, list[_Entry]], _T]
    ) -> _T | list:
        """Take one output's index entries under the lock, then ``read(fd, entries)``
        outside it, counting the bytes and translating I/O errors."""
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            entries = self._index.pop(output, None)
            if not entries:
                return []
            entries = list(entries)
            nbytes = sum(e[1] for e in entries)
            self._ledger.bytes_buffered -= nbytes  # discarded now; counted read once read
            self._inflight += 1
            fd = self._fd
        assert fd is not None  # entries exist only after the file was written
        try:
            result = read(fd, entries)
        except OSError as exc:
            with self._lock:
                self._release_locked()
            action = f"read {nbytes} bytes of output {output}"
            raise self._storage_error(exc, action, _READ_ADVICE) from exc
        with self._lock:
            self._ledger.bytes_read += nbytes
            self._release_locked()
        return result

    def _read_into_entries_blocking(
        self,
        fd: int,
        entries: list[_Entry],
        out: np.ndarray,
        placement: Mapping[int, tuple[slice, ...]],
    ) -> None:
        if self._pickled:
            for input_, array in self._read_entries_blocking(fd, entries):
                if input_ in placement:
                    place_blocking(out, placement[input_], array)
            return
        targets: list[tuple[int, memoryview]] = []
        staged: list[tuple[np.ndarray, np.ndarray]] = []
        for offset, nbytes, input_, shape in sorted(entries):
            if not nbytes or input_ not in placement:
                continue
            region = out[placement[input_]]
            if region.flags.c_contiguous and region.shape == tuple(shape):
                targets.append((offset, memoryview(region.reshape(-1).view(np.uint8))))
            else:
                buffer = np.empty(shape, dtype=self.dtype)
                staged.append((region, buffer))
                targets.append((offset, memoryview(buffer.reshape(-1).view(np.uint8))))
        for start, views in _coalesce(targets):
            preadv_all(fd, views, start)
        for region, buffer in staged:
            region[...] = buffer

    def _read_entries_blocking(
        self, fd: int, entries: list[_Entry]
    ) -> list[tuple[int, np.ndarray]]:
        """Allocate one buffer per entry and fill them, coalescing adjacent entries."""
        result: list[tuple[int, np.ndarray]] = []
        raw: list[tuple[int, int, np.ndarray]] = []  # (input, position in result, bytes)
        targets: list[tuple[int, memoryview]] = []
        for offset, nbytes, input_, shape in sorted(entries):
            if self._pickled:
                buffer = np.empty(nbytes, dtype=np.uint8)
                raw.append((input_, len(result), buffer))
                result.append((input_, buffer))
            else:
                array = np.empty(shape, dtype=self.dtype)
                buffer = array.reshape(-1).view(np.uint8)
                result.append((input_, array))
            if nbytes:
                targets.append((offset, memoryview(buffer)))
        for start, views in _coalesce(targets):
            preadv_all(fd, views, start)
        for input_, position, buffer in raw:
            result[position] = (input_, owned_array(np.asarray(pickle.loads(buffer))))
        return result

    # -- lifecycle ---------------------------------------------------------------------

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
            self._ledger.clear()
        if not first:
            self._close_done.wait()
            return
        try:
            if self._finalizer is not None:
                self._finalizer()
        except OSError as exc:
            advice = "Remove that directory by hand once no worker uses it."
            raise self._storage_error(exc, "remove the spilled shards", advice) from exc
        finally:
            self._close_done.set()

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        with self._lock:
            return self._ledger.statistics(self.kind, outputs=len(self._index))

    def _storage_error(self, exc: OSError, action: str, advice: str = "") -> RechunkStorageError:
        """Translate an ``OSError`` into an actionable :class:`RechunkStorageError`."""
        where = self._path or os.path.join(self.directory, _safe_name(self.name))
        reason = exc.strerror or str(exc) or type(exc).__name__
        message = (
            f"The disk shard store {self.name!r} could not {action} in {where!r}: {reason}. "
            + (advice or _WRITE_ADVICE)
        )
        if exc.errno is not None:
            return RechunkStorageError(exc.errno, message)
        return RechunkStorageError(message)


# -- plain helpers (blocking) ----------------------------------------------------------


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Write every byte of ``views`` at ``offset``, retrying short writes.

    Uses ``os.pwritev`` with up to ``IOV_MAX`` buffers per call where available, else one
    ``os.pwrite`` per buffer.
    """
    if hasattr(os, "pwritev"):
        _all_of(fd, views, offset, os.pwritev, "the disk accepted no bytes")
    else:  # pragma: no cover - platforms without pwritev
        _all_of(fd, views, offset, lambda f, v, o: os.pwrite(f, v[0], o), "no bytes written")


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Fill every byte of the writable ``views`` from ``offset``, retrying short reads."""
    if hasattr(os, "preadv"):
        _all_of(fd, views, offset, os.preadv, _ENDED_EARLY)
    else:  # pragma: no cover - platforms without preadv
        _all_of(fd, views, offset, _pread_into, _ENDED_EARLY)


_ENDED_EARLY = "the data file ended early (was it truncated or removed?)"


def _all_of(
    fd: int,
    views: Sequence[memoryview],
    offset: int,
    vectored: Callable[[int, list[memoryview], int], int],
    nothing_done: str,
) -> None:
    """Call ``vectored(fd, views, offset)`` (a ``preadv``/``pwritev``) until every byte of
    ``views`` is done, at most ``IOV_MAX`` buffers a call, resuming after short transfers."""
    pending = [v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        done = vectored(fd, pending[i : i + _IOV_MAX], offset)
        if done <= 0:
            raise OSError(errno.EIO, nothing_done)
        offset += done
        i = _advance(pending, i, done)


def _pread_into(fd: int, views: list[memoryview], offset: int) -> int:  # pragma: no cover
    data = os.pread(fd, views[0].nbytes, offset)
    views[0][: len(data)] = data
    return len(data)


def _advance(pending: list[memoryview], i: int, done: int) -> int:
    """Skip ``done`` bytes of ``pending[i:]``; return the index of the first unfinished view."""
    while done and i < len(pending):
        size = pending[i].nbytes
        if done >= size:
            done -= size
            i += 1
        else:
            pending[i] = pending[i][done:]
            done = 0
    return i


def _coalesce(targets: list[tuple[int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """Group ``(offset, view)`` pairs sorted by offset into runs of adjacent byte ranges."""
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, view in targets:
        if runs and offset == end and len(runs[-1][1]) < _IOV_MAX:
            runs[-1][1].append(view)
        else:
            runs.append((offset, [view]))
        end = offset + view.nbytes
    return runs


def _safe_name(name: str) -> str:
    """Return ``name`` reduced to a safe single path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:100] or "shard-store"


#: Name of the directory the worker plugin keeps its stores in, under the local directory.
ENGINE_DIRECTORY = "rechunk-p2p"


def _makedirs_tracked(path: str) -> list[str]:
    """Create ``path`` and its missing parents; return those this call created, top first."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    created = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue
        created.append(directory)
    return created


def _make_store_directory(parent: str, name: str, created: list[str]) -> str:
    """Create ``parent/name`` (``parent/name-XXXX`` if taken) and any missing parents.

    Parents this call created are appended to ``created``. If a sibling store removes the
    empty parent between our two ``mkdir`` calls (a closing store removes the engine's
    directory when it is empty), the parent is made again.
    """
    attempts = 100
    for attempt in range(attempts):
        created.extend(_makedirs_tracked(parent))
        path = os.path.join(parent, name)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return tempfile.mkdtemp(prefix=f"{name}-", dir=parent)
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            continue
        return path
    raise AssertionError("unreachable")  # pragma: no cover


def _remove_blocking(fd: int | None, path: str | None, created_parents: list[str]) -> None:
    """Close ``fd``, remove ``path`` recursively and the now-empty parents we created."""
    try:
        if fd is not None:
            os.close(fd)
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(path)
    for directory in reversed(created_parents):
        try:
            os.rmdir(directory)
        except OSError:
            break
    if path is not None and os.path.basename(os.path.dirname(path)) == ENGINE_DIRECTORY:
        # the engine's own directory under a worker's local directory: whichever store closes
        # last removes it, also when another store had created it (concurrent rechunks)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
