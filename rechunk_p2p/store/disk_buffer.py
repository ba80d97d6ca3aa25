"""A disk store's write buffer: pieces gathered in memory and written in the background,
one write in flight a store, ordered by output (regular batches a group at a time, see
:mod:`rechunk_p2p.store.disk_blocks`).

Where it runs: task threads and the offload pool (gathering), the store I/O pool
(writing); blocking. The buffering half of :class:`~rechunk_p2p.store.disk.DiskPieceStore`,
which holds the state named here and documents the locks.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.store.base import closed_error
from rechunk_p2p.store.disk_blocks import (
    Block,
    Group,
    group_of,
    group_pairs,
    group_rows,
    grouped,
    slabs,
)
from rechunk_p2p.store.ledger import PieceLedger, pair_keys


class DiskWriteBuffer:
    """**Thread-safe (guarded by `_lock`).** The write buffer of a disk store."""

    kind: str
    name: str
    _lock: threading.Lock
    _idle: threading.Condition
    _closed: bool
    _inflight: int
    _buffer_bytes: int
    _pending: list[Pending]
    _pending_bytes: int
    _flushing: int
    _flush_error: BaseException | None
    _groups: list[Group]
    _held: set[int]
    _ledger: PieceLedger
    _release_locked: Callable[[], None]
    _io_pool: Callable[[], OffloadPool]
    _write_rows_blocking: Callable[..., None]

    def _gather_blocking(
        self,
        item: Pending,
        outputs: np.ndarray,
        total: int,
        pairs: Callable[[], np.ndarray],
    ) -> int:
        """Add ``item`` (``total`` bytes of pieces for ``outputs``; ``pairs``, their pair
        keys) to the write buffer, once there is room; hand the buffer to the store I/O pool
        when it is half full. Returns ``total``."""
        with self._lock:
            # room first: the write in flight and the gathered pieces stay within the buffer
            while self._flushing and (
                self._flushing + self._pending_bytes + total > self._buffer_bytes
            ):
                self._idle.wait()
            if self._closed:
                self._ledger.forget_keys(pairs())
                raise closed_error(self.kind, self.name, "write pieces")
            self._raise_flush_error_locked()
            self._pending.append(item)
            self._pending_bytes += total
            self._ledger.in_memory(self._pending_bytes + self._flushing)
            self._held.update(outputs.tolist())
            self._ledger.stored(len(outputs), total)
            full = self._take_full_locked()
        if full:
            self._flush_pool().submit(self._flush_in_background_blocking, full)
        return total

    def _flush_pool(self) -> OffloadPool:
        """Where the buffer is written in the background: the store's I/O pool (the
        worker's). The writers go on cutting and receiving meanwhile; a store has one write
        in flight at a time (``_flushing``), which keeps the disk from serving several of its
        writes at once, and :meth:`close_blocking` waits for it (``_inflight``)."""
        return self._io_pool()

    def _take_full_locked(self) -> list[Pending]:
        """The gathered pieces to write in the background, once they are half the write
        buffer and no write is in flight (else the write in flight takes them when it is done).
        Hold `_lock`."""
        if self._flushing or self._pending_bytes < max(self._buffer_bytes // 2, 1):
            return []
        self._flushing = self._pending_bytes
        self._inflight += 1  # close waits for it
        return self._take_pending_locked()

    def _flush_in_background_blocking(self, pending: list[Pending]) -> None:
        """On the store I/O pool: write gathered pieces, then those gathered meanwhile if they
        are half the buffer; an error is kept for the store's next write or read to raise."""
        while pending:
            try:
                self._flush_blocking(pending)
            except BaseException as exc:  # re-raised to the store's next writer or reader
                with self._lock:
                    self._flush_error = exc
            with self._lock:
                self._flushing = 0
                failed = self._flush_error is not None or self._closed
                pending = [] if failed else self._take_full_locked()
                self._release_locked()
                self._idle.notify_all()

    def _raise_flush_error_locked(self) -> None:
        if self._flush_error is not None:
            raise self._flush_error

    def _take_pending_locked(self) -> list[Pending]:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        return pending

    def _flush_blocking(self, pending: list[Pending]) -> None:
        """Write gathered pieces ordered by output and input, so that each output's pieces
        lie one after another in the file: reading it back is one ``pread`` per flush.
        Regular batches are written a group at a time, one index row per output (see
        :mod:`rechunk_p2p.store.disk_blocks`)."""
        blocks = [p for p in pending if isinstance(p, Block)]
        pieces = [p for p in pending if not isinstance(p, Block)]
        try:
            if pieces:
                rows = np.concatenate([r for r, _ in pieces])
                views = [v for _, vs in pieces for v in vs]
                order = np.lexsort((rows["input"], rows["output"]))
                self._write_rows_blocking(rows[order], [views[k] for k in order.tolist()])
            for outputs, members in grouped(blocks):
                group = group_of(members)
                with self._lock:
                    group_id = len(self._groups)
                    self._groups.append(group)
                for outs, data in slabs(outputs, members):
                    rows = group_rows(outs, group_id, group.row_bytes)
                    pairs = functools.partial(_group_keys, outs, group)
                    self._write_rows_blocking(rows, [data.data], pairs)
        except RechunkRunError:
            if not self._closed:
                raise
            # closed meanwhile: the pieces were accepted before, and dropped by the close


#: What the write buffer gathers: pieces (their index rows and one view each), or a regular
#: batch whole.
Pending = tuple[np.ndarray, list[memoryview]] | Block


def _group_keys(outputs: np.ndarray, group: Group) -> np.ndarray:
    """The pair keys of the pieces of ``group`` for ``outputs``."""
    return pair_keys(*group_pairs(outputs, group))
