"""Cutting an input chunk whose pieces have one length along each axis in one strided copy.

Where it runs: task threads (a transfer task's cut).
"""

from __future__ import annotations

import numpy as np

from rechunk_p2p.cutting.joined import JoinedBlocks, copy_cut_blocking
from rechunk_p2p.errors import RechunkInputError


def cut_regular_blocking(
    data: np.ndarray | JoinedBlocks,
    slices: list[list[slice]],
    dtype: np.dtype | None = None,
    out: np.ndarray | None = None,
    lengths: list[int | None] | None = None,
) -> np.ndarray | None:
    """All pieces of ``data`` in one copy, when its cuts are regular; else ``None``.

    ``slices[axis]`` are the pieces of ``data`` along ``axis`` (contiguous, covering it). When
    the pieces along every axis have one length, they are the blocks of a reshape:
    the result has shape ``(n_pieces, *piece_shape)``, in C order, each
    C-contiguous, made by one strided copy instead of one copy (and one Python call) each,
    in ``dtype`` (default: ``data``'s; only a byte-order change is allowed). Chunks a
    transfer task made and did not join (:class:`JoinedBlocks`) are copied block by block.

    ``out``, a C-contiguous ``uint8`` buffer of at least ``data.nbytes`` bytes, receives the
    copy (the result is a view of it): a buffer used again for each input chunk costs no
    new pages, where a new array of the chunk's size is fresh memory each time (distributed
    has its workers return freed memory to the system at once).

    ``lengths``, the pieces' one length per axis where known
    (:meth:`~rechunk_p2p.planning.Partial.input_cut_lengths`; ``None`` where they differ),
    saves looking at every piece (an input chunk cut for thousands of outputs).

    >>> cut_regular_blocking(np.arange(4), [[slice(0, 2), slice(2, 4)]]).tolist()
    [[0, 1], [2, 3]]
    >>> cut_regular_blocking(np.arange(3), [[slice(0, 2), slice(2, 3)]]) is None
    True
    """
    dtype = data.dtype if dtype is None else np.dtype(dtype)
    if data.size == 0 or data.dtype.hasobject or not np.can_cast(data.dtype, dtype, "equiv"):
        return None
    grid = regular_grid(data.shape, slices, lengths)
    if grid is None:
        return None
    counts, sizes = grid
    ndim = data.ndim
    order = [2 * a for a in range(ndim)] + [2 * a + 1 for a in range(ndim)]
    shape = [counts[a] for a in range(ndim)] + sizes
    if out is None:
        blocks = np.empty(shape, dtype=dtype)
    else:
        if out.dtype != np.uint8 or out.ndim != 1 or out.nbytes < data.nbytes:
            raise RechunkInputError(
                f"out must be a 1-d uint8 buffer of at least {data.nbytes} bytes"
            )
        blocks = out[: data.nbytes].view(dtype).reshape(shape)
    if not (isinstance(data, JoinedBlocks) and copy_cut_blocking(data, blocks, counts, sizes)):
        split = np.asarray(data).reshape([v for pair in zip(counts, sizes) for v in pair])
        np.copyto(blocks, split.transpose(order), casting="equiv")
    return blocks.reshape(-1, *sizes)


def regular_grid(
    shape: tuple[int, ...], slices: list[list[slice]], lengths: list[int | None] | None = None
) -> tuple[list[int], list[int]] | None:
    """``(counts, lengths)``: how many pieces cut an array of ``shape`` along each axis,
    and their one length there, when the cuts ``slices`` are regular (see
    :func:`cut_regular_blocking`, which also says what ``lengths`` is); else ``None``.

    >>> regular_grid((4, 6), [[slice(0, 2), slice(2, 4)], [slice(0, 6)]])
    ([2, 1], [2, 6])
    """
    counts = [len(pieces) for pieces in slices]
    if lengths is None or len(lengths) != len(slices):
        found = [_one_length(pieces, n) for pieces, n in zip(slices, shape)]
    elif any(len(p) == 1 for p in slices):  # (a whole-axis piece: unknown chunk sizes)
        found = [n if len(p) == 1 else k for p, n, k in zip(slices, shape, lengths)]
    else:
        found = list(lengths)
    known = [n for n in found if n is not None]
    if len(known) != len(found) or [c * n for c, n in zip(counts, known)] != list(shape):
        return None
    return counts, known


def _one_length(pieces: list[slice], extent: int) -> int | None:
    """The one length of ``pieces`` of an axis of ``extent``, or ``None`` if they differ."""
    sizes = {len(range(*p.indices(extent))) for p in pieces}
    return sizes.pop() if len(sizes) == 1 else None
