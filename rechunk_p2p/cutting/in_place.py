"""Sending an input chunk's pieces as they lie in it: each worker's pieces as blocks of the
chunk, no cut.

Where it runs: task threads (a transfer task's cut); pure but for the arrays it views.

Why: a cut copies the whole input chunk into a buffer, grouped by destination, and the
batches view that buffer until their receivers acknowledged them. A worker's batches to
one peer wait for a message's worth (``comm.message-bytes-limit``), so with many workers a
worker's inputs are all in flight at once and every cut is a buffer of fresh pages: the
whole input again, each page faulted in and zeroed by the kernel (at 16 and 32 workers on
2 cores, every cut buffer of a 512 MiB rechunk was new). When a worker's pieces of an
input chunk form blocks of it (its outputs consecutive, as a run assigns them), each block
can travel from the chunk itself: its rows are the buffers of the gathering send
(:func:`~rechunk_p2p.transport.wire.payload_views`), and the receiver, which gets the
block's bytes in C order, views its pieces in place (:attr:`~rechunk_p2p.transport.wire.
Packed.along`). The sender's own pieces go into its store the same way, so its store must
copy pieces into their outputs as they come (:class:`~rechunk_p2p.store.assembling.
AssemblingMemoryStore`); a worker whose store keeps what it is given cuts as before.
"""

from __future__ import annotations

import math

import numpy as np

#: A block is sent in place only when its rows (the contiguous runs of its bytes in the
#: input chunk) are at least this long: shorter rows cost more as buffers of a send (a
#: Python object and a vector entry each) than the copy they save
MIN_ROW_BYTES = 1024

Block = tuple[np.ndarray, tuple[slice, ...], int]
"""``(positions among the input's outputs, the block's slices of the chunk, the axis its
pieces lie side by side along)``."""


def plan_blocks(
    shape: tuple[int, ...],
    itemsize: int,
    counts: list[int],
    lengths: list[int],
    chosen: np.ndarray,
) -> list[Block] | None:
    """The blocks of an input chunk of ``shape`` that hold the pieces ``chosen`` (ascending
    positions in the C-ordered grid of ``counts`` pieces of ``lengths``), each with its
    pieces side by side along one axis; ``None`` when a block's rows would be shorter than
    :data:`MIN_ROW_BYTES` (but for a block that is one contiguous run).

    Consecutive positions along the grid's last axis of more than one piece form one block;
    a worker's pieces of a chunk cut along several axes are one block per grid row.

    >>> [(p.tolist(), s, a) for p, s, a in plan_blocks((4, 1024), 8, [1, 4], [4, 256],
    ...                                                  np.array([1, 2]))]
    [([1, 2], (slice(0, 4, None), slice(256, 768, None)), 1)]
    """
    varying = [a for a, c in enumerate(counts) if c > 1]
    along = varying[-1] if varying else 0
    row = counts[along]
    # a block ends where the positions stop being consecutive or a grid row ends
    ends = np.flatnonzero((np.diff(chosen) != 1) | (chosen[1:] % row == 0)) + 1
    blocks: list[Block] = []
    for part in np.split(chosen, ends) if len(ends) else [chosen]:
        first = np.unravel_index(int(part[0]), counts)
        extent = list(lengths)
        extent[along] *= len(part)
        slices = tuple(slice(int(i) * n, int(i) * n + e) for i, n, e in zip(first, lengths, extent))
        row_bytes = _row_bytes(shape, extent, itemsize)
        if row_bytes < MIN_ROW_BYTES and row_bytes < itemsize * math.prod(extent):
            return None  # (a block in one run goes in place whatever its size)
        blocks.append((part, slices, along if len(part) > 1 else 0))
    return blocks


def _row_bytes(shape: tuple[int, ...], extent: list[int], itemsize: int) -> int:
    """The length in bytes of a block's contiguous runs in a C-contiguous array of
    ``shape``: its last axes, as far as the block spans them whole, and the next."""
    axis = len(shape) - 1
    while axis > 0 and extent[axis] == shape[axis]:
        axis -= 1
    return itemsize * math.prod(extent[axis:])
