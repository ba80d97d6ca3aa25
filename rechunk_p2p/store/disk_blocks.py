"""A disk store's regular batches: written output by output with one index row per output.

Where it runs: the store I/O pool (a disk store's writes) and its readers (task threads);
numpy only, no state of its own.

A regular batch (one input's pieces for many outputs, all of one shape, see
:attr:`~rechunk_p2p.transport.wire.Packed.regular`) is what a cut sends every worker. Held
thin rows make millions of them per worker, of a few dozen bytes a piece: one index row and
one Python step per piece outweighed the data. Instead the batches gathered for one flush
that go to the same outputs form a **group**: its bytes are laid out output-major (for each
output, the group's pieces in input order, one strided copy per batch), and the index gets
one row per output of the group, which names the group. A read expands such a row back into
the pieces it holds (:func:`expand_rows`), a few numpy operations per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

#: One index row: an output, an input, a byte range of the data file, a shape (an index into
#: the store's table of shapes), and a group: ``-1`` for a row of one piece, else the row
#: holds the pieces of that group for its output, one after another (``input`` and
#: ``shape`` unused, ``nbytes`` their sum).
ENTRY = np.dtype(
    [
        ("output", "i8"),
        ("input", "i8"),
        ("offset", "i8"),
        ("nbytes", "i8"),
        ("shape", "i4"),
        ("group", "i4"),
    ]
)

#: Bytes of a group laid out and written at a time (a flush copies its groups once, in
#: slabs of about this size, rather than holding a second copy of all it writes).
SLAB_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Block:
    """**Immutable.** One regular batch waiting in the write buffer: the pieces of
    ``input`` for ``outputs`` (ascending), ``size`` bytes each, one after another in
    ``payload`` (flat ``uint8``)."""

    outputs: np.ndarray
    input: int
    shape_id: int
    size: int
    payload: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.outputs) * self.size


@dataclass(frozen=True, slots=True)
class Group:
    """**Immutable.** The batches of one flush for one set of outputs: their inputs
    (ascending), each one's piece size in bytes and shape id."""

    inputs: np.ndarray
    sizes: np.ndarray
    shape_ids: np.ndarray

    @property
    def row_bytes(self) -> int:
        """Bytes of the group a single output holds."""
        return int(self.sizes.sum())


def grouped(blocks: list[Block]) -> list[tuple[np.ndarray, list[Block]]]:
    """``blocks`` by the outputs they go to, each group's blocks ordered by input:
    ``(outputs, blocks)`` pairs."""
    by_outputs: dict[bytes, tuple[np.ndarray, list[Block]]] = {}
    for block in blocks:
        key = block.outputs.tobytes()
        if key not in by_outputs:
            by_outputs[key] = (block.outputs, [])
        by_outputs[key][1].append(block)
    return [(outs, sorted(bs, key=lambda b: b.input)) for outs, bs in by_outputs.values()]


def group_of(blocks: list[Block]) -> Group:
    """The :class:`Group` record of ``blocks`` (ordered by input)."""
    return Group(
        inputs=np.array([b.input for b in blocks], dtype=np.int64),
        sizes=np.array([b.size for b in blocks], dtype=np.int64),
        shape_ids=np.array([b.shape_id for b in blocks], dtype=np.int32),
    )


def slabs(
    outputs: np.ndarray, blocks: list[Block], slab_bytes: int = SLAB_BYTES
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The bytes of ``blocks`` (one group, ordered by input) output-major, a slab of
    consecutive outputs at a time: ``(outputs of the slab, bytes)``, where the bytes hold,
    for each output of the slab, its pieces from every block in order.

    >>> a = Block(np.array([0, 1]), 5, 0, 2, np.array([1, 1, 2, 2], dtype="u1"))
    >>> b = Block(np.array([0, 1]), 7, 0, 1, np.array([3, 4], dtype="u1"))
    >>> [(o.tolist(), d.tolist()) for o, d in slabs(np.array([0, 1]), [a, b])]
    [([0, 1], [1, 1, 3, 2, 2, 4])]
    """
    row = sum(b.size for b in blocks)
    n = len(outputs)
    step = max(1, slab_bytes // max(row, 1))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        out = np.empty((hi - lo, row), dtype=np.uint8)
        column = 0
        for b in blocks:
            if b.size:
                rows = b.payload[lo * b.size : hi * b.size].reshape(hi - lo, b.size)
                out[:, column : column + b.size] = rows
            column += b.size
        yield outputs[lo:hi], out.reshape(-1)


def group_rows(outputs: np.ndarray, group_id: int, row_bytes: int) -> np.ndarray:
    """One index row per output of a slab of group ``group_id`` (offsets still to set)."""
    rows = np.zeros(len(outputs), dtype=ENTRY)
    rows["output"] = outputs
    rows["input"] = -1
    rows["nbytes"] = row_bytes
    rows["shape"] = -1
    rows["group"] = group_id
    return rows


def expand_rows(rows: np.ndarray, groups: list[Group]) -> np.ndarray:
    """``rows`` with every group row replaced by one row per piece it holds."""
    at = rows["group"] >= 0
    if not at.any():
        return rows
    parts = [rows[~at]]
    for row in rows[at]:
        group = groups[int(row["group"])]
        pieces = np.empty(len(group.inputs), dtype=ENTRY)
        pieces["output"] = row["output"]
        pieces["input"] = group.inputs
        pieces["nbytes"] = group.sizes
        pieces["offset"] = int(row["offset"]) + np.cumsum(group.sizes) - group.sizes
        pieces["shape"] = group.shape_ids
        pieces["group"] = -1
        parts.append(pieces)
    return np.concatenate(parts)


def group_pairs(outputs: np.ndarray, group: Group) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(output, input)`` pair of a slab of ``group``, as two arrays."""
    return np.repeat(outputs, len(group.inputs)), np.tile(group.inputs, len(outputs))
