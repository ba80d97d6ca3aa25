"""Copying pieces into the slabs that hold their output chunks.

Where it runs: offload pool and task threads (blocking; for
:class:`~rechunk_p2p.store.assembling.AssemblingMemoryStore`, outside its lock).

A slab is an array of shape ``(outputs, *output_shape)`` (see the store). Pieces that have
the same place in outputs lying in consecutive slots of one slab are copied with one strided
copy; a piece in an output of its own pages is one copy.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from rechunk_p2p.store.base import copy_into_blocking

#: Batches of at most this many pieces are placed by a loop over them.
FEW_PIECES = 16


def copy_inputs_blocking(
    arrays: dict[int, np.ndarray],
    slabs: np.ndarray,
    slots: np.ndarray,
    starts: np.ndarray,
    blocks: list[np.ndarray],
    runs: np.ndarray | None = None,
) -> None:
    """:func:`copy_pieces_blocking` of several inputs' pieces of the same outputs:
    ``blocks[i][k]`` goes to ``arrays[slabs[k]][slots[k]]`` at ``starts[i, k]``. Where the
    outputs lie in consecutive slots of their slabs and each input has one place in all of
    them (the usual batches of one message: one time step of every time series, say), each
    input costs one strided copy per slab, the slots worked out once."""
    plan = _slab_runs(arrays, slabs, slots, runs)
    shape = blocks[0].shape[1:]
    for place, block in zip(starts, blocks):
        if plan is None or not (place == place[0]).all():
            copy_pieces_blocking(arrays, slabs, slots, place, block, runs)
            continue
        region = tuple(slice(p, p + n) for p, n in zip(place[0].tolist(), shape))
        for a, b, slab, lo in plan:
            slab[(slice(lo, lo + b - a), *region)] = block[a:b]


def _slab_runs(
    arrays: dict[int, np.ndarray],
    slabs: np.ndarray,
    slots: np.ndarray,
    runs: np.ndarray | None,
) -> list[tuple[int, int, np.ndarray, int]] | None:
    """The pieces' runs of consecutive slots in one shared slab, as ``(first piece, end,
    slab, first slot)``; ``None`` where a piece's output has a slab of its own or the slots
    do not run (``runs``: as for :func:`copy_pieces_blocking`)."""
    ascending = runs is not None
    if runs is None:
        if len(slabs) > 1 and not (slabs[1:] >= slabs[:-1]).all():
            return None
        runs = np.flatnonzero(slabs[1:] != slabs[:-1]) + 1
    plan = []
    for a, b in itertools.pairwise([0, *runs.tolist(), len(slabs)]):
        slab, lo = arrays[int(slabs[a])], int(slots[a])
        if len(slab) == 1 or int(slots[b - 1]) - lo != b - a - 1:
            return None
        if not ascending and b - a > 2 and not (np.diff(slots[a:b]) == 1).all():
            return None
        plan.append((a, b, slab, lo))
    return plan


def copy_pieces_blocking(
    arrays: dict[int, np.ndarray],
    slabs: np.ndarray,
    slots: np.ndarray,
    starts: np.ndarray,
    blocks: np.ndarray,
    runs: np.ndarray | None = None,
) -> None:
    """Copy piece ``blocks[k]`` to ``arrays[slabs[k]][slots[k]]`` at ``starts[k]``: one
    strided copy for the pieces of one slab that have one place in their outputs, one copy
    per piece in an output of its own. ``runs``: the pieces' outputs ascend, and each of
    these positions starts a run of pieces in one slab; their slots in a slab then ascend
    too (see :meth:`~rechunk_p2p.store.assembling.AssemblingMemoryStore._allocate_locked`)."""
    shape = blocks.shape[1:]
    if len(blocks) <= FEW_PIECES:
        _copy_few_blocking(arrays, slabs.tolist(), slots.tolist(), starts.tolist(), blocks)
        return
    if all(len(arrays[sid]) == 1 for sid in arrays):  # outputs of their own: piece by piece
        for k, (sid, place) in enumerate(zip(slabs.tolist(), starts.tolist())):
            at: tuple[Any, ...] = (0, *(slice(p, p + n) for p, n in zip(place, shape)))
            copy_into_blocking(arrays[sid][at], blocks[k])
        return
    groups: list[tuple[np.ndarray | slice, np.ndarray]]
    ascending = runs is not None
    one_place = (starts == starts[0]).all()
    if one_place and runs is None:
        change = slabs[1:] != slabs[:-1]
        if change.any() and not (slabs[1:] >= slabs[:-1]).all():
            one_place = False
        else:
            runs = np.flatnonzero(change) + 1
    if one_place:
        # one place (the usual batch): a run of rows per slab
        assert runs is not None
        bounds = [0, *runs.tolist(), len(slabs)]
        groups = [
            (slice(a, b), np.concatenate(([slabs[a]], starts[0])))
            for a, b in itertools.pairwise(bounds)
        ]
    else:
        key = np.column_stack((slabs, starts))
        kinds, which = np.unique(key, axis=0, return_inverse=True)
        order = np.argsort(which.reshape(-1), kind="stable")
        ends = np.searchsorted(which.reshape(-1)[order], np.arange(len(kinds) + 1))
        groups = [(order[ends[g] : ends[g + 1]], kinds[g]) for g in range(len(kinds))]
    for rows, (sid, *place) in groups:
        slab = arrays[int(sid)]
        region: tuple[Any, ...] = tuple(slice(p, p + n) for p, n in zip(place, shape))
        chosen = slots[rows]
        source = blocks[rows]
        if len(slab) == 1:  # an output of its own: one copy per piece
            own: tuple[Any, ...] = (0, *region)
            for k in range(len(chosen)):
                copy_into_blocking(slab[own], source[k])
            continue
        lo, count = int(chosen[0]), len(chosen)
        if int(chosen[-1]) - lo == count - 1 and (
            ascending or count < 2 or (np.diff(chosen) == 1).all()
        ):
            rows_at: tuple[Any, ...] = (slice(lo, lo + count), *region)
        else:
            rows_at = (chosen, *region)
        slab[rows_at] = source


def _copy_few_blocking(
    arrays: dict[int, np.ndarray],
    slabs: list[int],
    slots: list[int],
    starts: list[list[int]],
    blocks: np.ndarray,
) -> None:
    """:func:`copy_pieces_blocking` of a few pieces, grouped by a loop: one copy per run of
    consecutive slots of one slab and place, one per piece elsewhere."""
    shape = blocks.shape[1:]
    groups: dict[tuple, list[int]] = {}
    for k, (sid, place) in enumerate(zip(slabs, starts)):
        groups.setdefault((sid, *place), []).append(k)
    for (sid, *place), rows in groups.items():
        slab = arrays[sid]
        region: tuple[Any, ...] = tuple(slice(p, p + n) for p, n in zip(place, shape))
        first, last = rows[0], rows[-1]
        lo = slots[first]
        if (
            len(rows) > 1
            and last - first == len(rows) - 1
            and all(slots[k] == lo + k - first for k in rows)
        ):
            run_at: tuple[Any, ...] = (slice(lo, lo + len(rows)), *region)
            slab[run_at] = blocks[first : last + 1]
            continue
        for k in rows:
            at: tuple[Any, ...] = (slots[k], *region)
            copy_into_blocking(slab[at], blocks[k])
