"""Pages of freed output chunks, kept for the next outputs of the same size while runs are open.

Where it runs: :meth:`OutputPages.take_blocking` in task threads and the offload pool (where
outputs are made); the give-back runs in whatever thread drops an output's last reference
(usually the worker's event loop, when distributed forgets the key: one ``list.append``
under a lock, or the unmapping that freeing did before); :meth:`OutputPages.open` and
:meth:`OutputPages.close` where runs open and close.

Why: an output chunk is a private anonymous mapping of its own (see
:func:`rechunk_p2p.store.base.empty_output`), so each new one is pages the kernel must
fault in and zero on first write: on a virtual machine, several times the copy that fills
it, as system time in the task thread that assembles the output. When outputs are consumed
as they are made (written to a zarr store, reduced), each is freed a task or two after it
was made, and its pages can serve the next output as they are: no fault, no zeroing (the
output is written whole before anyone reads it).

How: an output from the pool is an ndarray whose ``base`` is a small holder of the mapping;
when the last view of the output is gone, the holder's finalizer hands the mapping back
(or unmaps it, when the pool is closed or full). The pool keeps at most
``limit_bytes`` (64 MiB), only while a run is open on the worker, and unmaps everything it
keeps when the last run closes.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Callable

import numpy as np

from rechunk_p2p.store.allocator import HELD_TOP_BYTES

#: Bytes of freed output mappings kept while runs are open, at most: as much as malloc keeps
#: free at the top of a heap then (two outputs of up to 32 MiB fit, one of up to 64 MiB, and
#: larger ones are unmapped as before), so that the pages kept never weigh on a worker's
#: memory limit more than that
POOL_LIMIT_BYTES = HELD_TOP_BYTES


class _Holder:
    """**Immutable.** The base of an output array made from a pooled mapping: exposes the
    mapping's memory to numpy and gives the mapping back when it is freed."""

    __slots__ = ("__array_interface__", "_pages", "_pool", "_raw")

    def __init__(self, pool: OutputPages, pages: mmap.mmap) -> None:
        raw = np.frombuffer(pages, dtype=np.uint8)
        self._pool, self._pages = pool, pages
        self._raw: np.ndarray | None = raw
        self.__array_interface__ = raw.__array_interface__

    def __del__(self) -> None:
        pool, pages = self._pool, self._pages
        self._raw = None  # the mapping's only export, dropped before it may be closed
        pool._give_back(pages)


class OutputPages:
    """**Thread-safe (guarded by `_lock`).** Freed output mappings, by size, kept for reuse
    while at least one run is open.

    Parameters
    ----------
    limit_bytes
        Bytes of mappings kept at most.
    """

    def __init__(self, limit_bytes: int = POOL_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        # reentrant: an output freed by a collection that an allocation under the lock set off
        # gives its mapping back in the same thread
        self._lock = threading.RLock()
        self._open = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._held_bytes = 0
        #: outputs served from a kept mapping, and from new ones, since the process started
        self.reused = 0
        self.mapped = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of freed mappings kept now."""
        with self._lock:
            return self._held_bytes

    @property
    def keeping(self) -> bool:
        """Whether freed mappings are kept now (a run is open)."""
        with self._lock:
            return self._open > 0

    def open(self) -> None:
        """A run opens: freed outputs are kept from now on."""
        with self._lock:
            self._open += 1

    def close(self) -> Callable[[], None] | None:
        """A run closed; when it was the last, nothing freed is kept any more. Returns the
        blocking work of unmapping what was kept (for a thread), if anything was."""
        with self._lock:
            self._open = max(self._open - 1, 0)
            if self._open or not self._free:
                return None
            free, self._free, self._held_bytes = self._free, {}, 0
        dropped = [pages for kept in free.values() for pages in kept]

        def unmap_blocking() -> None:
            for pages in dropped:
                _unmap(pages)

        return unmap_blocking

    def take_blocking(self, nbytes: int) -> np.ndarray:
        """A C-contiguous ``uint8`` array of ``nbytes`` on a mapping of its own: a kept one
        when one of this size is free, else a new one (its pages faulted in on first write).
        """
        with self._lock:
            kept = self._free.get(nbytes)
            pages = kept.pop() if kept else None
            if pages is not None:
                self._held_bytes -= nbytes
                self.reused += 1
            else:
                self.mapped += 1
        if pages is None:
            pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        return np.asarray(_Holder(self, pages))

    def _give_back(self, pages: mmap.mmap) -> None:
        """An output's last view is gone: keep its mapping, or unmap it."""
        nbytes = len(pages)
        with self._lock:
            keep = self._open > 0 and self._held_bytes + nbytes <= self.limit_bytes
            if keep:
                self._free.setdefault(nbytes, []).append(pages)
                self._held_bytes += nbytes
        if not keep:
            _unmap(pages)


def _unmap(pages: mmap.mmap) -> None:
    """Unmap ``pages`` now, or (when something still exports its memory) when it is freed."""
    with contextlib.suppress(BufferError):
        pages.close()


#: The worker process's pool (opened and closed with the runs by the worker plugin)
OUTPUT_PAGES = OutputPages()
