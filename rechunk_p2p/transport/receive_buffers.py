"""Buffers that received messages' payloads are read into, used again once the pieces in one
were copied out.

Where it runs: the data plane's event loop (a buffer is taken when a request's payload is
read, and given back when its handler has returned); no locking.

Why: a receiving worker reads every message's payload into a new array, and distributed
starts workers with ``MALLOC_TRIM_THRESHOLD_`` set, so freed memory goes back to the system
and the next arrays are new pages, each faulted in and zeroed by the kernel as the socket's
bytes are copied in. Profiled at 32 workers of one thread on 2 cores (1 GiB all-to-all, a
fresh cluster), the kernel zeroing pages on the data planes' socket reads was 12 % of all
the workers' CPU. Where the receiver's store copies the pieces into their outputs (the
assembling memory store), a payload's buffer is free when the store returns: the next
message on any connection can be read into it. A store that keeps the pieces as views of
the payload (pieces kept as they came, or gathered for a spill) keeps its buffer too.
"""

from __future__ import annotations

import numpy as np

#: Free buffers kept at most, and their bytes at most: about what the concurrent requests
#: of a worker's peers need (one per inbound connection in flight; messages are at most
#: ``comm.message-bytes-limit``, 2 MiB by default)
MAX_FREE = 8
MAX_FREE_BYTES = 16 * 2**20


class ReceiveBuffers:
    """**Loop-confined** (the data plane's loop). Free payload buffers, lent out by size.

    Parameters
    ----------
    max_free
        At most this many free buffers are kept ...
    max_free_bytes
        ... and at most this many bytes of them (a larger buffer is never kept).
    """

    def __init__(self, max_free: int = MAX_FREE, max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self._max_free = max_free
        self._max_free_bytes = max_free_bytes
        self._free: list[np.ndarray] = []  # sorted by size
        self._free_bytes = 0
        self.made = 0  # buffers allocated
        self.reused = 0  # payloads read into a buffer used before

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers kept free (read from any thread: maybe a step behind)."""
        return self._free_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` array of ``nbytes``: a view of the smallest free buffer that holds it
        without wasting more than it holds, or a new array."""
        for i, buffer in enumerate(self._free):
            if nbytes <= buffer.nbytes <= 2 * nbytes:
                del self._free[i]
                self._free_bytes -= buffer.nbytes
                self.reused += 1
                return buffer[:nbytes]
        self.made += 1
        return np.empty(nbytes, dtype=np.uint8)

    def give_back(self, payload: np.ndarray) -> None:
        """``payload`` (an array :meth:`take` returned) is no longer read by anyone: keep its
        buffer for the next :meth:`take`, within the limits (the smallest free ones go
        first)."""
        buffer = payload if payload.base is None else payload.base
        if not isinstance(buffer, np.ndarray) or buffer.nbytes > self._max_free_bytes:
            return
        if any(b is buffer for b in self._free):
            return
        self._free.append(buffer)
        self._free.sort(key=lambda b: b.nbytes)
        self._free_bytes += buffer.nbytes
        while len(self._free) > self._max_free or self._free_bytes > self._max_free_bytes:
            self._free_bytes -= self._free.pop(0).nbytes

    def clear(self) -> None:
        """Let every free buffer go (the worker is idle)."""
        self._free.clear()
        self._free_bytes = 0
