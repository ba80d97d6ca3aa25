"""Shard stores in memory: one keeps the shards, one places them into their outputs.

Where it runs: offload pool and task threads (blocking; never on the event loop).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

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
from rechunk_p2p.errors import RechunkRunError


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
        self._ledger = ShardLedger()

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
            shards = 0
            for output, input_, array in batch:
                if self._ledger.admit(output, input_):
                    self._data.setdefault(output, {})[input_] = array
                    accepted += array.nbytes
                    shards += 1
            self._ledger.stored(shards, accepted)
        return accepted

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """Return the ``(input index, array)`` pairs of one output, sorted by input index.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.read_blocking`.
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
        """Copy each shard of ``output`` into ``out[placement[input]]`` and discard it.

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


class OutputLayout(Protocol):
    """Where shards go: the shape of each output chunk and each shard's place in it
    (:class:`rechunk_p2p.planning.Partial` is one)."""

    def output_shape(self, flat: int) -> tuple[int, ...]: ...

    def placement(self, output: int, input_: int) -> tuple[slice, ...]: ...


class AssemblingShardStore:
    """**Thread-safe (guarded by `_lock`).** Places each shard into its output chunk as it is
    written, so that reading an output is handing over an array already built.

    A written shard is copied once, into an output chunk allocated when its first shard
    arrives; the shard itself (a view of a received message, or a cut of a local input) is
    not kept. Reading an output then costs no copy and no per-shard work. The bytes held
    are the output chunks that have shards (``bytes_buffered`` counts the shards' bytes).

    Parameters
    ----------
    dtype
        The dtype of every shard.
    name
        Names the store in error messages.
    layout
        The output chunks' shapes and each shard's place in its output.
    """

    kind = "memory"

    def __init__(self, dtype: np.dtype, name: str, layout: OutputLayout) -> None:
        self.dtype = np.dtype(dtype)
        self.name = name
        self._layout = layout
        self._lock = threading.Lock()
        self._closed = False
        self._outputs: dict[int, tuple[np.ndarray, list[int]]] = {}
        self._ledger = ShardLedger()

    def __repr__(self) -> str:
        return f"<AssemblingShardStore {self.name!r} dtype={self.dtype}>"

    def write_blocking(self, shards: Iterable[Shard]) -> int:
        """Place shards into their output chunks, dropping ``(output, input)`` pairs already
        placed. A shard that is no piece of its output raises before anything is placed.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.write_blocking`.
        """
        layout = self._layout
        batch = []
        for shard in shards:
            output, input_, array = check_shard(shard, self.dtype, self.kind, self.name)
            batch.append((output, input_, array, self._where(output, input_, array)))
        todo = []
        accepted = 0
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write shards")
            for output, input_, array, where in batch:
                if not self._ledger.admit(output, input_):
                    continue
                held = self._outputs.get(output)
                if held is None:
                    shape = layout.output_shape(output)
                    held = self._outputs[output] = (np.empty(shape, self.dtype), [])
                held[1].append(input_)
                todo.append((held[0], where, array))
                accepted += array.nbytes
            self._ledger.stored(len(todo), accepted)
        for out, where, array in todo:  # outside the lock: shards of one output never overlap
            place_blocking(out, where, array)
        return accepted

    def _where(self, output: int, input_: int, array: np.ndarray) -> tuple[slice, ...]:
        try:
            where = self._layout.placement(output, input_)
        except (KeyError, IndexError):
            where = None
        shape = None if where is None else tuple(s.stop - s.start for s in where)
        if shape != array.shape:
            raise RechunkRunError(
                f"The shard of input {input_} for output {output} in store {self.name!r} has "
                f"shape {array.shape}; that output holds {shape or 'no piece of that input'}"
            )
        return where

    def take_blocking(self, output: int) -> tuple[np.ndarray | None, list[int]]:
        """The assembled output chunk (``None`` if no shard arrived) and the inputs placed
        in it; the store lets go of both."""
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            out, inputs = self._outputs.pop(output, (None, []))
            if out is not None:
                self._ledger.read(self._placed_bytes(output, inputs))
        return out, inputs

    def _placed_bytes(self, output: int, inputs: list[int]) -> int:
        itemsize = self.dtype.itemsize
        return sum(
            itemsize * math.prod(s.stop - s.start for s in self._layout.placement(output, i))
            for i in inputs
        )

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """The ``(input index, piece of the output)`` pairs of one output, sorted by input.

        See :meth:`rechunk_p2p.buffers.base.ShardStore.read_blocking`.
        """
        out, inputs = self.take_blocking(output)
        if out is None:
            return []
        return [(i, owned_array(out[self._layout.placement(output, i)])) for i in sorted(inputs)]

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """Copy each shard of ``output`` into ``out[placement[input]]`` and discard it."""
        built, inputs = self.take_blocking(output)
        for input_ in inputs:
            if input_ in placement:
                where = self._layout.placement(output, input_)
                place_blocking(out, placement[input_], built[where])
        return inputs

    def close_blocking(self) -> None:
        """Drop every output chunk; idempotent."""
        with self._lock:
            self._closed = True
            self._outputs.clear()
            self._ledger.clear()

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        with self._lock:
            return self._ledger.statistics(self.kind, outputs=len(self._outputs))
