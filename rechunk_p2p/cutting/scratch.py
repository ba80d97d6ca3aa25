"""Buffers that input chunks are cut into, used again once every batch cut into one is stored.

Where it runs: task threads take and release buffers; the data plane's loop releases them
when a batch was delivered. Thread-safe.

distributed has its workers give freed memory back to the system at once
(``MALLOC_TRIM_THRESHOLD_``), so an array the size of an input chunk is new pages each time it
is made, and a first write to a page costs a fault (on virtual machines several
microseconds). A run's task threads cut every input chunk into such an array, and its bytes
live until the last batch cut into it has been delivered to its worker. Keeping those arrays
and cutting the next input chunk into one that is free again costs no new pages. (A chunk
whose pieces go in place, :mod:`rechunk_p2p.cutting.in_place`, takes no buffer: with many
workers, a worker's batches wait for a message's worth and its buffers are all in use at
once, so that none is free again before the last input.)

A batch is delivered when its receiver acknowledged it. The data plane's transport (TCP or
TLS, also between workers of one process) gives the receiver bytes of its own, so from then
on nothing refers to the sender's buffer; a transport that handed the receiver the sender's
arrays would have to copy them first.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import numpy as np


class CutBuffers:
    """**Thread-safe (guarded by `_lock`).** The cut buffers of one run, each lent to its
    holders.

    :meth:`take` lends a buffer held by the cut itself (the buffer is its own holder);
    :meth:`hold` adds the batches that view it and leave the thread; :meth:`release` ends one
    holder's use (a second release of the same holder is ignored). A buffer whose last holder
    let go is kept for the next :meth:`take`. A holder never released (a batch dropped, not
    delivered) keeps its buffer from being lent again; the buffer is freed with the last
    array that views it.

    Parameters
    ----------
    max_free
        At most this many free buffers are kept (the smallest are let go first) ...
    max_free_bytes
        ... and at most this many bytes of them (a buffer larger than that is not kept).
    """

    def __init__(self, max_free: int = 4, max_free_bytes: int = 2**63) -> None:
        self._lock = threading.RLock()  # (a weak reference's callback may run under it)
        self._max_free = max_free
        self._max_free_bytes = max_free_bytes
        self._free: list[np.ndarray] = []
        # id of a lent buffer -> (a weak reference to it, ids of its holders)
        self._lent: dict[int, tuple[weakref.ref, set[int]]] = {}
        self._open = True
        self.made = 0  # buffers allocated

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` buffer of at least ``nbytes``: the smallest free one that fits, or a
        new one; held by itself until :meth:`release` of ``(buffer, buffer)``."""
        with self._lock:
            # (by position: ``list.remove`` would compare arrays element by element)
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            else:
                buffer = None
                self.made += 1
        if buffer is None:
            buffer = np.empty(nbytes, dtype=np.uint8)
        key = id(buffer)
        with self._lock:
            self._lent[key] = (weakref.ref(buffer, lambda _: self._forget(key)), {key})
        return buffer

    def hold(self, buffer: np.ndarray | None, holders: Iterable[object]) -> None:
        """Add ``holders`` of a lent ``buffer`` (for anything else, nothing happens)."""
        with self._lock:
            entry = self._entry(buffer)
            if entry is not None:
                entry[1].update(id(h) for h in holders)

    def release(self, buffer: np.ndarray | None, holder: object) -> None:
        """End ``holder``'s use of a lent ``buffer`` (for anything else, nothing happens);
        after the last one, the buffer is free for :meth:`take`."""
        with self._lock:
            entry = self._entry(buffer)
            if entry is None:
                return
            entry[1].discard(id(holder))
            if entry[1]:
                return
            del self._lent[id(buffer)]
            if self._open and buffer.nbytes <= self._max_free_bytes:  # type: ignore[union-attr]
                self._free.append(buffer)  # type: ignore[arg-type]
                sizes = [b.nbytes for b in self._free]
                while sizes and (len(sizes) > self._max_free or sum(sizes) > self._max_free_bytes):
                    k = sizes.index(min(sizes))
                    del self._free[k], sizes[k]

    def close(self) -> None:
        """Let every buffer go (no more inputs); later releases are ignored. Idempotent."""
        with self._lock:
            self._open = False
            self._free.clear()
            self._lent.clear()

    @property
    def free(self) -> int:
        """Free buffers kept."""
        with self._lock:
            return len(self._free)

    def _entry(self, buffer: np.ndarray | None) -> tuple[weakref.ref, set[int]] | None:
        """The entry of a lent buffer (under the lock)."""
        if buffer is None:
            return None
        entry = self._lent.get(id(buffer))
        if entry is None or entry[0]() is not buffer:
            return None
        return entry

    def _forget(self, key: int) -> None:
        """A lent buffer was freed with a holder never released: drop its entry."""
        with self._lock:
            entry = self._lent.get(key)
            if entry is not None and entry[0]() is None:
                del self._lent[key]
