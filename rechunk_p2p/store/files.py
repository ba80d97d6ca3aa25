"""A disk store's files and directories: positioned vectored I/O, and the store's own
directory, made and removed with the parents it created.

Where it runs: the threads that call (task threads, the offload pool); blocking, no state.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence

from rechunk_p2p.store.direct import ENDED_EARLY

try:
    _IOV_MAX = max(1, min(int(os.sysconf("SC_IOV_MAX")), 1024))
except (AttributeError, ValueError, OSError):  # pragma: no cover - platform dependent
    _IOV_MAX = 16


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
        if len(views) == 1 and os.preadv(fd, views, offset) == views[0].nbytes:
            return  # the usual case, done in one call
        _all_of(fd, views, offset, os.preadv, ENDED_EARLY)
    else:  # pragma: no cover - platforms without preadv
        _all_of(fd, views, offset, _pread_into, ENDED_EARLY)


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


def read_targets_blocking(fd: int, targets: list[tuple[int, memoryview]]) -> None:
    """Fill each ``(file offset, view)`` target, one ``preadv`` per run of adjacent ones."""
    targets.sort(key=lambda t: t[0])
    for start, views in _coalesce(targets):
        preadv_all(fd, views, start)


def safe_name(name: str) -> str:
    """Return ``name`` reduced to a safe single path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:100] or "piece-store"


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


def make_store_directory(parent: str, name: str, created: list[str]) -> str:
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


def remove_blocking(fds: tuple[int, ...], path: str | None, created_parents: list[str]) -> None:
    """Close ``fds``, remove ``path`` recursively and the now-empty parents we created."""
    try:
        errors = []
        for fd in fds:
            try:
                os.close(fd)
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
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
