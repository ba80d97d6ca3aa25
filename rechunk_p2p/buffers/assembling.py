"""A memory store that assembles each output chunk as its shards arrive.

Where it runs: offload pool and task threads (blocking; never on the event loop).

The plain :class:`~rechunk_p2p.buffers.memory.MemoryShardStore` keeps the arrays it is given
until the output's task reads them. Those arrays are views of the buffers they came in (a
received batch's payload, an input chunk's cut), and such a buffer holds shards of many
outputs, so it is freed only when the last of them was read: a worker held every shard it
received until its last output was assembled, and then the outputs too (twice its share of
the data at the peak), and assembled every output after the barrier, one copy per shard on
the task thread. This store copies each shard into its output chunk when it is written
(allocated at its first shard), so a batch's buffer is free as soon as the batch is
stored, the worker holds its share of the data once, and reading an output after the
barrier only hands over the array.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from rechunk_p2p.buffers.base import (
    SMALL_COPY_BYTES,
    Shard,
    ShardLedger,
    StoreStatistics,
    check_array,
    check_shard,
    closed_error,
    copy_into_blocking,
    empty_output,
    pair_keys,
    touch_pages_blocking,
)
from rechunk_p2p.buffers.wire import Packed, unpack_blocking, unpack_blocks
from rechunk_p2p.errors import RechunkRunError, RechunkTypeError


class _Output:
    """**Guarded by the store's lock.** One output chunk being filled."""

    __slots__ = (
        "array",
        "bytes",
        "dims",
        "output",
        "placed",
        "placement",
        "shard_bytes",
        "writing",
    )

    def __init__(
        self, output: int, array: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> None:
        self.output = output
        self.array = array
        self.bytes = memoryview(array.reshape(-1).view(np.uint8))  # C-contiguous, new
        self.dims = tuple(zip(array.shape, array.strides))  # (length, stride) per axis
        self.placement = placement
        self.placed: set[int] = set()  # inputs whose shard was copied in
        self.shard_bytes = 0
        self.writing = 0  # copies into ``array`` in progress


class AssemblingMemoryStore:
    """**Thread-safe (guarded by `_lock`).** Copies each shard into its output chunk on write.

    Shards of one output are copied outside the lock, from any number of threads (they fill
    disjoint regions); :meth:`take_output_blocking` waits for copies into that output still
    in progress. Not for object dtype, nor for axes of unknown chunk sizes (the output's
    shape must be known before its first shard arrives).

    Parameters
    ----------
    dtype
        The dtype of every shard and output.
    name
        Names the store in error messages.
    output_shape
        The shape of output chunk ``flat``.
    placement
        Where each input's shard goes in output ``flat``: ``{input: slices of the output}``.
    """

    kind = "memory"

    def __init__(
        self,
        dtype: np.dtype,
        name: str,
        output_shape: Callable[[int], tuple[int, ...]],
        placement: Callable[[int], Mapping[int, tuple[slice, ...]]],
    ) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise RechunkTypeError(f"{type(self).__name__} cannot hold object dtype")
        self.name = name
        self._output_shape = output_shape
        self._placement = placement
        self._lock = threading.Condition()
        self._closed = False
        self._outputs: dict[int, _Output] = {}
        self._held = 0  # bytes of output chunks allocated and not taken yet
        self._ledger = ShardLedger()

    def __repr__(self) -> str:
        return f"<AssemblingMemoryStore {self.name!r} dtype={self.dtype}>"

    def write_blocking(self, shards: Iterable[Shard]) -> int:
        """Copy shards into their outputs, dropping ``(output, input)`` pairs stored before;
        return the bytes accepted.

        Raises
        ------
        RechunkTypeError
            A shard is not an array of the store's dtype (nothing is stored).
        RechunkRunError
            The store is closed, or a shard is not a piece of its output or has the wrong
            shape (the shards before it in the batch are stored).
        """
        batch = [check_shard(s, self.dtype, self.kind, self.name) for s in shards]
        outputs = [output for output, _, _ in batch]
        inputs = [input_ for _, input_, _ in batch]
        keys = pair_keys(outputs, inputs)
        todo = self._begin(outputs, keys)
        done = 0
        try:
            for target, k in zip(*todo):
                self._place_blocking(target, inputs[k], batch[k][2])
                done += 1
        finally:
            accepted = self._end(todo, done, [a.nbytes for _, _, a in batch], keys, inputs)
        return accepted

    def write_blocks_blocking(
        self, outputs: Sequence[int] | np.ndarray, input_: int, blocks: np.ndarray
    ) -> int:
        """Copy shards ``blocks[i]`` of outputs ``outputs[i]``, all from input ``input_`` and
        of one shape, into their outputs, dropping pairs stored before; return the bytes
        accepted.

        The batch of a regular cut (this worker's own shards of an input, or a batch as it
        came off the wire): one check of the array for all of them, and a small shard whose
        place in its output is one contiguous run is copied as a memory move straight from
        the batch's bytes, without an array object per shard (the 3-D workload stores
        131,072 shards of 4 KiB per worker).

        Raises
        ------
        RechunkTypeError
            ``blocks`` is not an array of the store's dtype (nothing is stored).
        RechunkRunError
            As :meth:`write_blocking`, or ``blocks`` does not hold one shard per output.
        """
        input_ = operator.index(input_)
        blocks = check_array(blocks, self.dtype, self.kind, self.name, f"input {input_}'s batch")
        if isinstance(outputs, np.ndarray):
            outputs = outputs.tolist()
        else:
            outputs = [operator.index(o) for o in outputs]
        if blocks.ndim < 1 or len(blocks) != len(outputs):
            raise RechunkRunError(
                f"Store {self.name!r} got {len(outputs)} outputs and blocks of shape "
                f"{blocks.shape} from input {input_}: one block per output expected"
            )
        blocks = np.ascontiguousarray(blocks)
        shape = blocks.shape[1:]
        nbytes = blocks[0].nbytes if len(blocks) else 0
        keys = pair_keys(outputs, input_)
        todo = self._begin(outputs, keys)
        source = None
        if 0 < nbytes <= SMALL_COPY_BYTES:
            source = memoryview(blocks.reshape(-1).view(np.uint8))
        done = 0
        # the place of one input's shard is often the same in each output (maps to time
        # series: one step of each; row blocks to column blocks: one band of rows), so the
        # start found for one output serves the next when place and layout are equal
        last: tuple[object, object, int | None] = (None, None, None)
        try:
            for target, k in zip(*todo):
                start = None
                if source is not None:
                    where = target.placement.get(input_)
                    if where is not None and where == last[0] and target.dims == last[1]:
                        start = last[2]
                    else:
                        start = _run_start(where, target.dims, shape)
                        last = (where, target.dims, start)
                if start is None:
                    self._place_blocking(target, input_, blocks[k])
                else:  # a memory move with the GIL held (see place_blocking)
                    target.bytes[start : start + nbytes] = source[k * nbytes : (k + 1) * nbytes]
                done += 1
        finally:
            n = len(outputs)
            accepted = self._end(todo, done, [nbytes] * n, keys, [input_] * n)
        return accepted

    def write_packed_blocking(self, batch: Iterable[Packed]) -> int:
        """Copy the shards of batches as they came off the wire into their outputs (the
        batches' payloads are not kept)."""
        accepted = 0
        for packed in batch:
            regular = unpack_blocks(packed, self.dtype)
            if regular is None:
                accepted += self.write_blocking(unpack_blocking(packed, self.dtype))
            else:
                accepted += self.write_blocks_blocking(packed.outputs, *regular)
        return accepted

    def _begin(self, outputs: list[int], keys: list[int]) -> tuple[list[_Output], list[int]]:
        """Admit the pairs of ``keys`` (:func:`pair_keys`; pair ``k`` is of output
        ``outputs[k]``), allocating outputs at their first shard: for the new pairs, their
        outputs and their indices ``k``, each counted as a copy in progress into its output
        until :meth:`_end`. (Two lists, not a tuple per pair: the collector tracks tuples.)"""
        targets: list[_Output] = []
        chosen: list[int] = []
        with self._lock:
            if self._closed:
                raise closed_error(self.kind, self.name, "write shards")
            fresh = self._ledger.admit_keys(keys)
            known = self._outputs
            for k, output in enumerate(outputs):
                if fresh is not None and not fresh[k]:
                    continue
                target = known.get(output)
                if target is None:
                    target = self._new_output(output)
                target.writing += 1
                targets.append(target)
                chosen.append(k)
        return targets, chosen

    def _end(
        self,
        todo: tuple[list[_Output], list[int]],
        done: int,
        nbytes: list[int],
        keys: list[int],
        inputs: list[int],
    ) -> int:
        """Account the first ``done`` copies of ``todo`` as stored (pair ``k``: ``nbytes[k]``
        bytes from input ``inputs[k]``) and give the rest back to the ledger (they may come
        again); the bytes stored."""
        accepted = 0
        targets, chosen = todo
        with self._lock:
            for n, (target, k) in enumerate(zip(targets, chosen)):
                target.writing -= 1
                if n < done:
                    target.placed.add(inputs[k])
                    target.shard_bytes += nbytes[k]
                    accepted += nbytes[k]
            self._ledger.forget_keys(keys[k] for k in chosen[done:])
            self._ledger.stored(done, accepted)
            self._lock.notify_all()
        return accepted

    def take_output_blocking(self, output: int) -> tuple[np.ndarray | None, list[int]]:
        """Hand over output chunk ``output`` and forget it: the array (``None`` if no shard
        of it was written) and the inputs whose shards it lacks, sorted. Waits for copies
        into it still in progress."""
        with self._lock:
            target = self._outputs.get(output)
            while target is not None and target.writing and not self._closed:
                self._lock.wait()
            if self._closed:
                raise closed_error(self.kind, self.name, f"read output {output}")
            if target is None:
                return None, sorted(self._placement(output))
            del self._outputs[output]
            target.bytes.release()
            self._held -= target.array.nbytes
            self._ledger.read(target.shard_bytes)
        missing = []
        if len(target.placed) != len(target.placement):
            missing = sorted(set(target.placement) - target.placed)
        return target.array, missing

    def close_blocking(self) -> None:
        """Drop every output; idempotent."""
        with self._lock:
            self._closed = True
            self._outputs.clear()
            self._held = 0
            self._ledger.clear()
            self._lock.notify_all()

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters (in memory: the output chunks begun)."""
        with self._lock:
            return self._ledger.statistics(self.kind, outputs=len(self._outputs))

    def _new_output(self, output: int) -> _Output:
        """Allocate output ``output`` (under the lock)."""
        array = empty_output(self._output_shape(output), self.dtype)
        touch_pages_blocking(array)
        target = _Output(output, array, self._placement(output))
        self._outputs[output] = target
        self._held += array.nbytes
        self._ledger.in_memory(self._held)
        return target

    def _place_blocking(self, target: _Output, input_: int, array: np.ndarray) -> None:
        where = target.placement.get(input_)
        if where is None:
            raise RechunkRunError(
                f"Store {self.name!r} got a shard of output {target.output} from input "
                f"{input_}, which has no piece of that output"
            )
        region = target.array[(*where, Ellipsis)]
        if region.shape != array.shape:
            raise RechunkRunError(
                f"Store {self.name!r} got a shard of shape {array.shape} for output "
                f"{target.output} from input {input_}; its piece there has shape {region.shape}"
            )
        copy_into_blocking(region, array)


def _run_start(
    where: tuple[slice, ...] | None,
    dims: tuple[tuple[int, int], ...],
    shape: tuple[int, ...],
) -> int | None:
    """Where a shard of ``shape`` placed at ``where`` starts in the bytes of an output of
    ``dims`` (its ``_Output.dims``), when that place is one contiguous run of them; ``None``
    otherwise (no place, not contiguous, or a place that does not match ``shape``: the
    caller's general path raises for that)."""
    if where is None or len(where) != len(dims) or len(shape) != len(dims):
        return None
    start = 0
    spans = False  # an axis before this one has a piece longer than 1: the rest must be whole
    for piece, length, (size, stride) in zip(where, shape, dims):
        first, stop, step = piece.indices(size)
        if step != 1 or stop - first != length or (spans and length != size):
            return None
        if length != 1:
            spans = True
        start += first * stride
    return start
