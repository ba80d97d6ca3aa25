"""A run's pieces split by output: the first outputs filled in memory, the rest spilled.

Where it runs: task threads and the offload pool (blocking; never on an event loop).

``storage: auto`` chooses this store when a worker's share of a run is larger than its memory
budget: rather than spilling every piece, the outputs that fit the budget are filled in
memory as their pieces arrive (:class:`AssemblingMemoryStore`) and only the others go to
disk (:class:`DiskPieceStore`). Each output lives in exactly one of the two stores, chosen
when the store is made, so every read and write goes to one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from rechunk_p2p.store.assembling import AssemblingMemoryStore
from rechunk_p2p.store.base import Piece, StoreKind, StoreStatistics, check_piece
from rechunk_p2p.store.disk import DiskPieceStore
from rechunk_p2p.transport.wire import Packed, split_packed_blocking

if TYPE_CHECKING:
    from rechunk_p2p.spec import ShuffleSpec

#: Pieces moved from memory to disk are written in batches of about this many bytes
#: (:meth:`SplitStore.spill_blocking`): the views of a batch keep their outputs' memory
#: until the disk store has written them
SPILL_BATCH_BYTES = 16 * 2**20


class SplitStore:
    """**Thread-safe** (each part guards itself; the split changes only for outputs that
    have no piece yet, :meth:`place`, or while the caller keeps every other user out,
    :meth:`spill_blocking`). Outputs ``in_memory`` are assembled in memory, every
    other output's pieces are spilled.

    Parameters
    ----------
    memory
        The store of the outputs in memory.
    disk
        The store of the others.
    in_memory
        One boolean per flat output of the sub-shuffle: whether it is held in memory
        (outputs past its end are spilled).
    """

    kind: StoreKind = "memory+disk"
    copies_pieces = False  # (its disk part keeps batches as given)
    fills_outputs = False  # (nor does its disk part)

    def __init__(
        self, memory: AssemblingMemoryStore, disk: DiskPieceStore, in_memory: np.ndarray
    ) -> None:
        self.memory = memory
        self.disk = disk
        self.dtype = memory.dtype
        self.name = memory.name
        self._in_memory = np.array(in_memory, dtype=bool)  # (its own: place changes it)

    def __repr__(self) -> str:
        held = int(self._in_memory.sum())
        return f"<SplitStore {self.name!r} dtype={self.dtype} outputs in memory={held}>"

    def holds_in_memory(self, output: int) -> bool:
        """Whether output ``output`` is assembled in memory (taken with
        :meth:`take_output_blocking`) rather than read back from disk."""
        return 0 <= output < len(self._in_memory) and bool(self._in_memory[output])

    def place(self, outputs: np.ndarray, *, in_memory: bool) -> None:
        """Assemble ``outputs``, which have no piece here yet (a continuation moved them to
        this worker), in memory or from disk. Called before their pieces can come."""
        self._in_memory[np.asarray(outputs, dtype=np.int64)] = in_memory

    def spill_blocking(self) -> int:
        """Move every output assembled in memory to disk, with the pieces placed in it so
        far (the worker is short of memory), in batches of about :data:`SPILL_BATCH_BYTES`;
        from now on every piece is spilled. The caller keeps writers and readers of the
        store out meanwhile (:class:`~rechunk_p2p.worker.store_gate.StoreGate`). Returns
        the bytes moved."""
        outputs = np.flatnonzero(self._in_memory).tolist()
        self._in_memory[:] = False
        moved, batch, nbytes = 0, [], 0
        for output in outputs:
            pieces = self.memory.evict_blocking([output])
            batch.extend(pieces)
            nbytes += sum(p[2].nbytes for p in pieces)
            if nbytes >= SPILL_BATCH_BYTES:
                moved += self.disk.write_blocking(batch)
                batch, nbytes = [], 0
        return moved + (self.disk.write_blocking(batch) if batch else 0)

    def _mask(self, outputs: Iterable[int]) -> np.ndarray:
        flats = np.fromiter(outputs, dtype=np.int64)
        mask = np.zeros(len(flats), dtype=bool)
        inside = (flats >= 0) & (flats < len(self._in_memory))
        mask[inside] = self._in_memory[flats[inside]]
        return mask

    # -- writing -----------------------------------------------------------------------

    def write_blocking(self, pieces: Iterable[Piece]) -> int:
        """Store pieces in the part that holds their output; the bytes accepted. The whole
        batch is checked before either part stores anything."""
        batch = [check_piece(s, self.dtype, self.kind, self.name) for s in pieces]
        mask = self._mask(s[0] for s in batch).tolist()
        here = [s for s, m in zip(batch, mask) if m]
        spilled = [s for s, m in zip(batch, mask) if not m]
        return self._both(here, spilled, "write_blocking")

    def write_packed_blocking(self, batch: Iterable[Packed]) -> int:
        """Store batches as they came off the wire, each split between the two parts (views
        of its payload when its in-memory outputs come first, the usual case)."""
        here: list[Packed] = []
        spilled: list[Packed] = []
        for packed in batch:
            mask = self._mask(packed.outputs)
            if mask.all():
                here.append(packed)
            elif not mask.any():
                spilled.append(packed)
            else:
                kept, rest = split_packed_blocking(packed, mask, self.dtype)
                here.append(kept)
                spilled.append(rest)
        return self._both(here, spilled, "write_packed_blocking")

    def _both(self, here: list, spilled: list, method: str) -> int:
        accepted = getattr(self.memory, method)(here) if here else 0
        if spilled:
            accepted += getattr(self.disk, method)(spilled)
        return accepted

    # -- reading -----------------------------------------------------------------------

    def assemble_blocking(self, spec: ShuffleSpec, output: int) -> tuple[np.ndarray, list[int]]:
        """An output from the part that holds it (filled as its pieces came, or read back
        from disk)."""
        if self.holds_in_memory(output):
            return self.memory.assemble_blocking(spec, output)
        return self.disk.assemble_blocking(spec, output)

    def take_output_blocking(self, output: int) -> tuple[np.ndarray | None, list[int]]:
        """An output held in memory, as :meth:`AssemblingMemoryStore.take_output_blocking`."""
        return self.memory.take_output_blocking(output)

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """A spilled output's pieces (:meth:`DiskPieceStore.read_blocking`)."""
        return self.disk.read_blocking(output)

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """A spilled output read into ``out`` (:meth:`DiskPieceStore.read_into_blocking`)."""
        return self.disk.read_into_blocking(output, out, placement)

    def read_stacked_blocking(self, output: int, out: np.ndarray, order: list[int]) -> list[int]:
        """A spilled output read into ``out`` (:meth:`DiskPieceStore.read_stacked_blocking`)."""
        return self.disk.read_stacked_blocking(output, out, order)

    def forget_outputs_blocking(self, outputs: Iterable[int]) -> None:
        """Forget that ``outputs`` (read already) got their pieces: they are assembled
        again from pieces sent anew."""
        outputs = list(outputs)
        self.memory.forget_outputs_blocking(outputs)
        self.disk.forget_outputs_blocking(outputs)

    # -- lifecycle -----------------------------------------------------------------------

    def close_blocking(self) -> None:
        """Close both parts (the disk part removes its files); idempotent."""
        try:
            self.memory.close_blocking()
        finally:
            self.disk.close_blocking()

    def statistics(self) -> StoreStatistics:
        """Both parts' counters added up; ``bytes_spilled`` is the disk part's, and
        ``max_bytes_in_memory`` the sum of both parts' peaks (an upper bound)."""
        a, b = self.memory.statistics(), self.disk.statistics()
        return StoreStatistics(
            kind=self.kind,
            pieces=a.pieces + b.pieces,
            duplicates=a.duplicates + b.duplicates,
            bytes_written=a.bytes_written + b.bytes_written,
            bytes_read=a.bytes_read + b.bytes_read,
            bytes_buffered=a.bytes_buffered + b.bytes_buffered,
            outputs=a.outputs + b.outputs,
            max_bytes_in_memory=a.max_bytes_in_memory + b.max_bytes_in_memory,
            bytes_spilled=b.bytes_spilled,
        )
