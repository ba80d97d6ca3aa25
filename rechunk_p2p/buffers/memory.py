"""A shard store that keeps shards in memory.

Where it runs: offload pool and task threads (blocking; never on the event loop).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import numpy as np

from rechunk_p2p.buffers.base import (
    Shard,
    StoreStatistics,
    check_shard,
    closed_error,
    owned_array,
    place_blocking,
)


class MemoryShardStore:
    """**Thread-safe (guarded by `_lock`).** Keeps the arrays it is given, per output.

    Arrays are stored as given (no copy), so a shard that is a view keeps its base alive and
    the writer must not modify an array after handing it over. Reads return the stored
    arrays themselves when they are C-contiguous and writeable, otherwise a C-ordered copy.

    Parameters
    ----------
    dtype
        The dtype of every shard.
    name
        Names the store in error messages.
    """

    kind = "memory"

    def __init__(self, dtype: np.dtype, name: str) -> None:
        self.dtype = np.dtype(dtype)
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        self._data: dict[int, dict[int, np.ndarray]] = {}
        self._seen: set[tuple[int, int]] = set()
        self._shards = 0
        self._duplicates = 0
        self._bytes_written = 0
        self._bytes_read = 0
        self._bytes_buffered = 0

    def __repr__(self) -> str:
        return f"<MemoryShardStore {self.name!r} dtype={self.dtype}>"

    def write_blocking(self, shards: Iterable[Shard]) -> int:
        """Store shards, dropping ``(output, input)`` pairs already stored.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.write_blocking`.
        """
        batch = [check_shard(s, self.dtype, self.kind, self.name) for s in shards]
        accepted = 0
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write shards")
            for output, input_, array in batch:
                key = (output, input_)
                if key in self._seen:
                    self._duplicates += 1
                    continue
                self._seen.add(key)
                self._data.setdefault(output, {})[input_] = array
                accepted += array.nbytes
                self._shards += 1
            self._bytes_written += accepted
            self._bytes_buffered += accepted
        return accepted

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """Return the ``(input index, array)`` pairs of one output, sorted by input index.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.read_blocking`.
        """
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            arrays = self._data.pop(output, {})
            nbytes = sum(a.nbytes for a in arrays.values())
            self._bytes_read += nbytes
            self._bytes_buffered -= nbytes
        return [(input_, owned_array(arrays[input_])) for input_ in sorted(arrays)]

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """Copy each shard of ``output`` into ``out[placement[input]]`` and discard it.

        Returns the input indices placed. No intermediate copy is made.
        """
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            arrays = self._data.pop(output, {})
            nbytes = sum(a.nbytes for a in arrays.values())
            self._bytes_read += nbytes
            self._bytes_buffered -= nbytes
        for input_, array in arrays.items():
            if input_ in placement:
                place_blocking(out, placement[input_], array)
        return list(arrays)

    def close_blocking(self) -> None:
        """Drop every array; idempotent."""
        with self._lock:
            self._closed = True
            self._data.clear()
            self._seen.clear()
            self._bytes_buffered = 0

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        with self._lock:
            return StoreStatistics(
                kind=self.kind,
                shards=self._shards,
                duplicates=self._duplicates,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                bytes_buffered=self._bytes_buffered,
                outputs=len(self._data),
            )
