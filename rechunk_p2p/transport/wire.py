"""Packing many pieces into one buffer for the wire, and unpacking them again.

Where it runs: task threads (``pack_blocking``) and the offload pool (``unpack_blocking``);
never on an event loop. Packing turns every piece bound for one worker into one header of
small integers and one payload, so that sending and receiving cost the data plane's loop the
same few operations whatever the number of pieces. A payload is the pieces one after another,
or a block of the input chunk that holds them side by side (:func:`pack_box`), sent from the
chunk as it lies (:mod:`rechunk_p2p.cutting.in_place`).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from rechunk_p2p.errors import RechunkRunError

Piece = tuple[int, int, np.ndarray]
"""``(output index, input index, array)``; flat indices within one sub-shuffle."""


@dataclass(frozen=True, slots=True)
class Packed:
    """**Immutable.** Pieces of one sender for one destination, as header and payload.

    ``outputs[i]``, ``inputs[i]`` and ``shapes[i]`` describe piece ``i``; its elements lie
    in ``payload`` (raw bytes, one piece after another; pickled arrays for object dtype).
    ``outputs`` is a tuple, or a ``range`` where they are consecutive (a regular cut's batch
    to one worker usually is: it then travels as two numbers).

    ``along``: in a :attr:`regular` batch, the axis along which the pieces lie side by side
    in ``payload``: its bytes are then one block of the input chunk in C order (the pieces'
    shape with ``along`` times the count), sent from the input chunk as it is, no cut. 0,
    the default, is the same as one piece after another. A sender's ``payload`` may then
    be a strided view of the input chunk (``uint8``, its last axis contiguous: see
    :func:`payload_views`); a received one is contiguous.
    """

    outputs: Sequence[int]
    inputs: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    payload: np.ndarray
    along: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    @property
    def regular(self) -> bool:
        """Whether the batch has pieces, all from one input and of one shape (a regular
        cut's batch, as :func:`pack_blocks` makes it)."""
        n = len(self.outputs)
        inputs, shapes = self.inputs, self.shapes
        return bool(n) and inputs.count(inputs[0]) == n and shapes.count(shapes[0]) == n

    def header(self) -> dict:
        """The small part of the message (msgpack-friendly lists). A :attr:`regular` batch
        names its input and shape once, instead of once per piece (a batch of 4 KiB pieces
        holds 512 of them)."""
        outputs = self.outputs
        named: dict = (
            {"first": outputs.start, "count": len(outputs)}
            if isinstance(outputs, range) and outputs.step == 1
            else {"outputs": list(outputs)}
        )
        if self.regular:
            regular = {**named, "input": self.inputs[0], "shape": list(self.shapes[0])}
            return {**regular, "along": self.along} if self.along else regular
        return {
            **named,
            "inputs": list(self.inputs),
            "shapes": [list(s) for s in self.shapes],
        }

    @classmethod
    def from_message(cls, header: dict, payload: np.ndarray) -> Packed:
        if "first" in header:
            outputs: Sequence[int] = range(header["first"], header["first"] + header["count"])
        else:
            outputs = tuple(header["outputs"])
        if "input" in header:
            n, shape = len(outputs), tuple(header["shape"])
            along = header.get("along", 0)
            if not isinstance(along, int) or not 0 <= along < max(len(shape), 1):
                raise RechunkRunError(f"Packed header names axis {along!r} of pieces {shape}")
            return cls(outputs, (header["input"],) * n, (shape,) * n, payload, along)
        return cls(
            outputs,
            tuple(header["inputs"]),
            tuple(tuple(s) for s in header["shapes"]),
            payload,
        )


def pack_blocking(pieces: list[Piece], dtype: np.dtype) -> Packed:
    """Copy pieces into one contiguous payload (pickled for object dtype)."""
    outputs = tuple(s[0] for s in pieces)
    inputs = tuple(s[1] for s in pieces)
    shapes = tuple(s[2].shape for s in pieces)
    if dtype.hasobject:
        data = pickle.dumps([s[2] for s in pieces], protocol=5)
        return Packed(outputs, inputs, shapes, np.frombuffer(data, dtype="u1"))
    itemsize = dtype.itemsize
    payload = np.empty(sum(s[2].size for s in pieces) * itemsize, dtype="u1")
    offset = 0
    for _, _, arr in pieces:
        n = arr.size * itemsize
        if n:
            dst = payload[offset : offset + n].view(dtype).reshape(arr.shape)
            np.copyto(dst, arr, casting="equiv")
        offset += n
    return Packed(outputs, inputs, shapes, payload)


def pack_blocks(outputs: np.ndarray, input_: int, blocks: np.ndarray, dtype: np.dtype) -> Packed:
    """Pieces ``blocks[i]`` (of output ``outputs[i]``, all from ``input_``) as one batch.

    ``blocks`` is C-contiguous (a slice of what
    :func:`~rechunk_p2p.cutting.regular.cut_regular_blocking` returns): the payload is a view
    of it, no copy.
    """
    shape = tuple(blocks.shape[1:])
    n = len(outputs)
    payload = np.ascontiguousarray(blocks).reshape(-1).view(np.uint8)
    return Packed(_named(outputs), (input_,) * n, (shape,) * n, payload)


def _named(outputs: np.ndarray) -> Sequence[int]:
    """``outputs`` as a batch names them: a ``range`` when consecutive, else a tuple."""
    n = len(outputs)
    first = int(outputs[0]) if n else 0
    if n > 2 and int(outputs[-1]) - first == n - 1 and (np.diff(outputs) == 1).all():
        return range(first, first + n)
    return tuple(outputs.tolist())


def pack_box(
    outputs: np.ndarray, input_: int, box: np.ndarray, along: int, shape: tuple[int, ...]
) -> Packed:
    """Pieces of ``shape`` lying side by side along axis ``along`` of ``box`` (a view of an
    input chunk whose last axis is contiguous), of outputs ``outputs``, as one batch whose
    payload is ``box`` itself: no copy (see :attr:`Packed.along`)."""
    n = len(outputs)
    return Packed(_named(outputs), (input_,) * n, (shape,) * n, box.view(np.uint8), along)


def payload_views(payload: np.ndarray) -> list[memoryview]:
    """The bytes of ``payload`` in C order as buffers, without copying: one for a contiguous
    payload, else one per contiguous run (a box of an input chunk, see :func:`pack_box`).

    >>> rows = np.arange(12, dtype="u1").reshape(3, 4)[:, 1:3]
    >>> [bytes(v) for v in payload_views(rows)]
    [b'\\x01\\x02', b'\\x05\\x06', b'\\t\\n']
    """
    if payload.flags.c_contiguous:
        return [payload.reshape(-1).view(np.uint8).data]
    # the trailing axes that lie contiguously form one run; the others are iterated
    lead, run = payload.ndim, payload.itemsize
    while lead and payload.strides[lead - 1] == run:
        lead -= 1
        run *= payload.shape[lead]
    if lead == payload.ndim or min(payload.strides) < 0:  # (no contiguous run: a copy)
        return [np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data]
    # each run's byte offset from the first, in C order; then slices of one memoryview
    # spanning them all (a slice costs a fraction of what a numpy view per run does)
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(payload.shape[:lead], payload.strides[:lead]):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    raw = payload.view(np.uint8)  # (its last axis is contiguous)
    span = np.lib.stride_tricks.as_strided(
        raw, shape=(int(offsets[-1]) + run,), strides=(1,), writeable=False
    )
    whole = span.data
    return [whole[o : o + run] for o in offsets.tolist()]


def in_order(packed: Packed, dtype: np.dtype) -> Packed:
    """``packed`` with its pieces one after another in a contiguous payload: itself when
    they are (``along`` 0, contiguous), else a copy (for a store that keeps payloads)."""
    if not packed.along and packed.payload.flags.c_contiguous:
        return packed
    blocks = np.ascontiguousarray(_blocks_of(packed, dtype))
    return replace(packed, payload=blocks.reshape(-1).view(np.uint8), along=0)


def _blocks_of(packed: Packed, dtype: np.dtype) -> np.ndarray:
    """The pieces of a :attr:`~Packed.regular` batch as one ``(n, *shape)`` view of its
    payload (strided where the pieces lie side by side along an axis), checked."""
    n, shape, along = len(packed.outputs), packed.shapes[0], packed.along
    _check_payload(packed, n * math.prod(shape) * dtype.itemsize)
    if not along:
        if packed.payload.flags.c_contiguous:
            return packed.payload.view(dtype).reshape(n, *shape)
        # (a sender's box with its pieces stacked along the first axis)
        return packed.payload.view(dtype).reshape(n * shape[0], *shape[1:]).reshape(n, *shape)
    box = list(shape)
    box[along] *= n
    split = packed.payload.view(dtype).reshape(box)
    split = split.reshape(*box[:along], n, shape[along], *box[along + 1 :])
    return np.moveaxis(split, along, 0)


def output_array(packed: Packed) -> np.ndarray:
    """``packed.outputs`` as an int64 array."""
    outputs = packed.outputs
    if isinstance(outputs, range):
        return np.arange(outputs.start, outputs.stop, outputs.step, dtype=np.int64)
    return np.array(outputs, dtype=np.int64)


def unpack_blocks(packed: Packed, dtype: np.dtype) -> tuple[int, np.ndarray] | None:
    """``(input, blocks)`` when every piece of a batch comes from one input and has one
    shape (a regular cut's batch, as :func:`pack_blocks` makes it): piece ``i`` is
    ``blocks[i]``, all of them one view of the payload. ``None`` for any other batch.

    Raises
    ------
    RechunkRunError
        The payload's size does not match the pieces' shapes.
    """
    if dtype.hasobject or not packed.regular:
        return None
    return packed.inputs[0], _blocks_of(packed, dtype)


def packed_sizes(packed: Packed, dtype: np.dtype) -> np.ndarray:
    """The byte count of each piece of ``packed`` (fixed-width ``dtype``), checked against
    its payload."""
    shapes = packed.shapes
    if shapes and all(s == shapes[0] for s in shapes):
        sizes = np.full(len(shapes), int(np.prod(shapes[0], dtype=np.int64)) * dtype.itemsize)
    else:
        sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in shapes], dtype=np.int64)
        sizes *= dtype.itemsize
    _check_payload(packed, int(sizes.sum()))
    return sizes


def split_packed_blocking(
    packed: Packed, keep: np.ndarray, dtype: np.dtype
) -> tuple[Packed, Packed]:
    """``packed`` as two batches: the pieces where ``keep`` is true, and the others.

    When the kept pieces come first (a batch's outputs are ascending, and a worker's outputs
    split at one output), both batches view the payload; otherwise each gets a copy of its
    pieces' bytes. Not for object dtype.

    Examples
    --------
    >>> p = pack_blocking([(0, 5, np.arange(2.0)), (1, 5, np.arange(3.0))], np.dtype("f8"))
    >>> kept, rest = split_packed_blocking(p, np.array([True, False]), np.dtype("f8"))
    >>> kept.outputs, kept.payload.view("f8").tolist(), rest.outputs, rest.nbytes
    ((0,), [0.0, 1.0], (1,), 24)
    """
    packed = in_order(packed, dtype)
    sizes = packed_sizes(packed, dtype)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    kept = np.flatnonzero(keep)
    rest = np.flatnonzero(~keep)
    k = len(kept)
    if k and kept[-1] == k - 1:  # a prefix: two views
        cut = int(ends[k - 1])
        return _subset(packed, kept, packed.payload[:cut]), _subset(
            packed, rest, packed.payload[cut:]
        )
    parts = []
    for chosen in (kept, rest):
        bounds = zip(starts[chosen].tolist(), ends[chosen].tolist())
        pieces = [packed.payload[a:b] for a, b in bounds]
        payload = np.concatenate(pieces) if pieces else packed.payload[:0]
        parts.append(_subset(packed, chosen, payload))
    return parts[0], parts[1]


def _subset(packed: Packed, chosen: np.ndarray, payload: np.ndarray) -> Packed:
    """The header of ``packed``'s pieces ``chosen`` (ascending), with ``payload``."""
    pick = chosen.tolist()
    return Packed(
        tuple(packed.outputs[i] for i in pick),
        tuple(packed.inputs[i] for i in pick),
        tuple(packed.shapes[i] for i in pick),
        payload,
    )


def unpack_blocking(packed: Packed, dtype: np.dtype) -> list[Piece]:
    """The pieces of a packed batch, as arrays viewing its payload (no copy)."""
    if dtype.hasobject:
        arrays = pickle.loads(packed.payload.tobytes())
        return list(zip(packed.outputs, packed.inputs, arrays))
    shapes = packed.shapes
    if packed.regular:  # a regular cut: one reshape
        return list(zip(packed.outputs, packed.inputs, _blocks_of(packed, dtype)))
    pieces: list[Piece] = []
    offset = 0
    itemsize = dtype.itemsize
    for out, inp, shape in zip(packed.outputs, packed.inputs, shapes):
        count = int(np.prod(shape, dtype=np.int64))
        n = count * itemsize
        arr = packed.payload[offset : offset + n].view(dtype).reshape(shape)
        pieces.append((out, inp, arr))
        offset += n
    _check_payload(packed, offset)
    return pieces


def _check_payload(packed: Packed, need: int) -> None:
    """Raise when ``packed``'s payload does not hold ``need`` bytes, its pieces' total."""
    if need != packed.nbytes:
        raise RechunkRunError(f"Packed payload has {packed.nbytes} bytes, its pieces {need}")
