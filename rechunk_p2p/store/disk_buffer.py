"""A disk store's write buffer: pieces gathered in memory and written in the background,
one write in flight a store, ordered by output (regular batches a group at a time, see
:mod:`rechunk_p2p.store.disk_blocks`).

Where it runs: task threads and the offload pool (gathering), the store I/O pool
(writing); blocking. A part of :class:`~rechunk_p2p.store.disk.DiskPieceStore`.
"""

from __future__ import annotations

import functools
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
from rechunk_p2p.store.disk_parts import PieceIndex, StoreCore
from rechunk_p2p.store.ledger import pair_keys


class WriteBuffer:
    """**Thread-safe (guarded by its store's lock, ``core.lock``).** A disk store's write
    buffer: pieces gathered (up to ``buffer_bytes``) and written ordered by output by one
    background write at a time, on ``pool()``, through ``write_rows(rows, views, pairs)``
    (the store's write of index rows and their bytes); regular batches a group at a time,
    numbered in ``index``. The store's I/O in flight (``core.inflight``) counts the
    background write, so a close waits for it."""

    def __init__(
        self,
        core: StoreCore,
        index: PieceIndex,
        buffer_bytes: int,
        write_rows: Callable[..., None],
        pool: Callable[[], OffloadPool],
    ) -> None:
        self._core = core
        self._index = index
        self.buffer_bytes = int(buffer_bytes)
        self._write_rows = write_rows
        self._pool = pool
        self._pending: list[Pending] = []  # not written yet
        self._pending_bytes = 0
        self._flushing = 0  # bytes of the background write in flight
        self._flush_error: BaseException | None = None

    def gather_blocking(
        self,
        item: Pending,
        outputs: np.ndarray,
        total: int,
        pairs: Callable[[], np.ndarray],
    ) -> int:
        """Add ``item`` (``total`` bytes of pieces for ``outputs``; ``pairs``, their pair
        keys) to the buffer, once there is room; hand the buffer to the store I/O pool when
        it is half full. Returns ``total``."""
        core = self._core
        with core.lock:
            # room first: the write in flight and the gathered pieces stay within the buffer
            while self._flushing and (
                self._flushing + self._pending_bytes + total > self.buffer_bytes
            ):
                core.idle.wait()
            if core.closed:
                core.ledger.forget_keys(pairs())
                raise closed_error(core.kind, core.name, "write pieces")
            self._raise_flush_error_locked()
            self._pending.append(item)
            self._pending_bytes += total
            core.ledger.in_memory(self._pending_bytes + self._flushing)
            core.held.update(outputs.tolist())
            core.ledger.stored(len(outputs), total)
            full = self._take_full_locked()
        if full:
            # the writers go on cutting and receiving meanwhile; one write in flight a store
            # keeps the disk from serving several of its writes at once
            self._pool().submit(self._flush_in_background_blocking, full)
        return total

    def drain_blocking(self) -> None:
        """Wait for the background write, raise its error if it failed, and write what is
        gathered now (a read's first step: every piece stored is then in the file)."""
        core = self._core
        with core.lock:
            while self._flushing:  # its rows are published when it ends
                core.idle.wait()
            self._raise_flush_error_locked()
            pending = self._take_pending_locked()
        if pending:
            self._flush_blocking(pending)

    def clear_locked(self) -> None:
        """The store closed: drop what is gathered. Hold ``core.lock``."""
        self._pending.clear()
        self._pending_bytes = 0

    def _take_full_locked(self) -> list[Pending]:
        """The gathered pieces to write in the background, once they are half the buffer
        and no write is in flight (else the write in flight takes them when it is done)."""
        if self._flushing or self._pending_bytes < max(self.buffer_bytes // 2, 1):
            return []
        self._flushing = self._pending_bytes
        self._core.inflight += 1  # close waits for it
        return self._take_pending_locked()

    def _flush_in_background_blocking(self, pending: list[Pending]) -> None:
        """On the store I/O pool: write gathered pieces, then those gathered meanwhile if they
        are half the buffer; an error is kept for the store's next write or read to raise."""
        core = self._core
        while pending:
            try:
                self._flush_blocking(pending)
            except BaseException as exc:  # re-raised to the store's next writer or reader
                with core.lock:
                    self._flush_error = exc
            with core.lock:
                self._flushing = 0
                failed = self._flush_error is not None or core.closed
                pending = [] if failed else self._take_full_locked()
                core.release_locked()
                core.idle.notify_all()

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
                self._write_rows(rows[order], [views[k] for k in order.tolist()])
            for outputs, members in grouped(blocks):
                group = group_of(members)
                group_id = self._index.add_group(group)
                for outs, data in slabs(outputs, members):
                    rows = group_rows(outs, group_id, group.row_bytes)
                    pairs = functools.partial(_group_keys, outs, group)
                    self._write_rows(rows, [data.data], pairs)
        except RechunkRunError:
            if not self._core.closed:
                raise
            # closed meanwhile: the pieces were accepted before, and dropped by the close


#: What the write buffer gathers: pieces (their index rows and one view each), or a regular
#: batch whole.
Pending = tuple[np.ndarray, list[memoryview]] | Block


def _group_keys(outputs: np.ndarray, group: Group) -> np.ndarray:
    """The pair keys of the pieces of ``group`` for ``outputs``."""
    return pair_keys(*group_pairs(outputs, group))
