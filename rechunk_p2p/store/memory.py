"""A piece store that keeps pieces in memory.

Where it runs: offload pool and task threads (blocking; never on the event loop).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.store.base import (
    SMALL_COPY_BYTES,
    Piece,
    StoreKind,
    StoreStatistics,
    check_piece,
    closed_error,
    copy_into_blocking,
    owned_array,
    place_blocking,
)
from rechunk_p2p.store.ledger import PieceLedger
from rechunk_p2p.store.reading import read_output_blocking
from rechunk_p2p.transport.wire import Packed, unpack_blocking

if TYPE_CHECKING:
    from rechunk_p2p.spec import ShuffleSpec


class MemoryPieceStore:
    """**Thread-safe (guarded by `_lock`).** Keeps the arrays it is given, per output.

    Arrays are stored as given (no copy), so a piece that is a view keeps its base alive and
    the writer must not modify an array after handing it over. Reads return the stored
    arrays themselves when they are C-contiguous and writeable, otherwise a C-ordered copy.

    Parameters
    ----------
    dtype
        The dtype of every piece.
    name
        Names the store in error messages.
    """

    kind: StoreKind = "memory"
    copies_pieces = False  # (pieces are kept as given: views of their payload)
    fills_outputs = False

    def __init__(self, dtype: np.dtype, name: str) -> None:
        self.dtype = np.dtype(dtype)
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        self._data: dict[int, dict[int, np.ndarray]] = {}
        self._ledger = PieceLedger()

    def __repr__(self) -> str:
        return f"<MemoryPieceStore {self.name!r} dtype={self.dtype}>"

    def assemble_blocking(self, spec: ShuffleSpec, output: int) -> tuple[np.ndarray, list[int]]:
        """See :meth:`rechunk_p2p.store.base.PieceStore.assemble_blocking` (its pieces
        placed into a new array)."""
        return read_output_blocking(self, spec, output)

    def spill_blocking(self) -> int:
        """Nothing moves: outputs of unknown shape or of objects stay with their pieces."""
        return 0

    def write_blocking(self, pieces: Iterable[Piece]) -> int:
        """Store pieces, dropping ``(output, input)`` pairs already stored.

        See :meth:`rechunk_p2p.store.base.PieceStore.write_blocking`.
        """
        batch = [check_piece(s, self.dtype, self.kind, self.name) for s in pieces]
        accepted = 0
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write pieces")
            count = 0
            for output, input_, array in batch:
                if self._ledger.admit(output, input_):
                    self._data.setdefault(output, {})[input_] = array
                    accepted += array.nbytes
                    count += 1
            self._ledger.stored(count, accepted)
            self._ledger.in_memory(self._ledger.bytes_buffered)
        return accepted

    def write_packed_blocking(self, batch: Iterable[Packed]) -> int:
        """Store the pieces of batches as they came off the wire (views of their payloads:
        a batch's payload is freed once every piece of it was read)."""
        return self.write_blocking(s for p in batch for s in unpack_blocking(p, self.dtype))

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """Return the ``(input index, array)`` pairs of one output, sorted by input index.

        See :meth:`rechunk_p2p.store.base.PieceStore.read_blocking`.
        """
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            arrays = self._data.pop(output, {})
            self._ledger.read(sum(a.nbytes for a in arrays.values()))
        return [(input_, owned_array(arrays[input_])) for input_ in sorted(arrays)]

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """Copy each piece of ``output`` into ``out[placement[input]]`` and discard it.

        Returns the input indices placed. No intermediate copy is made.
        """
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            arrays = self._data.pop(output, {})
            self._ledger.read(sum(a.nbytes for a in arrays.values()))
        for input_, array in arrays.items():
            if input_ in placement:
                place_blocking(out, placement[input_], array)
        return list(arrays)

    def read_stacked_blocking(self, output: int, out: np.ndarray, order: list[int]) -> list[int]:
        """Copy the pieces of ``output`` one after another into C-contiguous ``out``, in the
        order of the inputs ``order``, and discard them.

        For outputs whose pieces lie one after another in memory
        (:meth:`rechunk_p2p.planning.Partial.stacked_inputs`): one copy per piece into the
        next bytes of ``out`` (:func:`~rechunk_p2p.store.base.copy_into_blocking`), and
        nothing else per piece. Returns the inputs placed, in order,
        stopping at the first one missing. Not for object dtype.

        Raises
        ------
        RechunkRunError
            The store is closed, or the pieces do not fill ``out`` exactly.
        """
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            arrays = self._data.pop(output, {})
            self._ledger.read(sum(a.nbytes for a in arrays.values()))
        target = out.reshape(-1).view(np.uint8)
        bytes_of = target.data
        placed: list[int] = []
        offset = 0
        for input_ in order:
            array = arrays.get(input_)
            if array is None:
                return placed
            end = offset + array.nbytes
            if end > target.nbytes:
                break
            if 0 < array.nbytes <= SMALL_COPY_BYTES and array.flags.c_contiguous:
                # the usual piece (thousands per output): one memcpy with the GIL held, no
                # copy_into_blocking checks (their cost exceeds a small piece's copy)
                bytes_of[offset:end] = array.reshape(-1).view(np.uint8).data
            elif array.nbytes:
                contiguous = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                copy_into_blocking(target[offset:end], contiguous)
            offset = end
            placed.append(input_)
        if offset != target.nbytes:
            raise RechunkRunError(
                f"The pieces of output {output} in store {self.name!r} hold {offset} of its "
                f"{target.nbytes} bytes"
            )
        return placed

    def forget_outputs_blocking(self, outputs: Iterable[int]) -> None:
        """Forget that ``outputs`` (read already) got their pieces: they are assembled
        again from pieces sent anew."""
        with self._lock:
            self._ledger.forget_outputs(outputs)

    def close_blocking(self) -> None:
        """Drop every array; idempotent."""
        with self._lock:
            self._closed = True
            self._data.clear()
            self._ledger.clear()

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        with self._lock:
            return self._ledger.statistics(self.kind, outputs=len(self._data))
