"""The plan's cost estimate and its one-line warning where per-piece cost dominates."""

from __future__ import annotations

import dataclasses

import dask
import dask.array as da
import numpy as np

import rechunk_p2p
from rechunk_p2p.planning.cost import (
    SECONDS_PER_BYTE,
    SECONDS_PER_ORDERED_PAIR,
    SECONDS_PER_PIECE,
    SECONDS_PER_TASK,
    estimate,
    piece_advice,
)


def _held(shape: tuple[int, ...], chunks: tuple[int, ...]) -> da.Array:
    """An array whose chunks are data, as a held input's are (no transfer joins them)."""
    x = da.ones(shape, chunks=chunks)
    keys = dask.core.flatten(x.__dask_keys__())
    blocks = {k: np.broadcast_to(np.float64(0), x.blocks[k[1:]].shape) for k in keys}
    return da.Array(blocks, x.name, x.chunks, x.dtype)


def test_the_estimate_adds_up_its_unit_costs() -> None:
    cost = estimate(10, 1000, 2**20)
    assert cost.tasks == 10 * SECONDS_PER_TASK and cost.pieces == 1000 * SECONDS_PER_PIECE
    assert cost.bytes == 2**20 * SECONDS_PER_BYTE
    assert cost.total == cost.tasks + cost.pieces + cost.bytes
    ordered = estimate(10, 1000, 2**20, n_ordered=4000)
    assert ordered.pieces == 1000 * SECONDS_PER_PIECE + 4000 * SECONDS_PER_ORDERED_PAIR
    assert estimate(1000, 0, 0).dominant == "tasks" and estimate(0, 0, 2**30).dominant == "bytes"


def test_advice_names_the_side_that_bounds_the_pieces() -> None:
    # rows into columns: pieces are one row high (input) and a few columns wide (output)
    rows = piece_advice(((1,) * 64, (512,)), ((64,), (4,) * 128))
    assert rows == "longer output chunks along axis 1, or longer input chunks along axis 0"
    # columns into rows: the other way round
    cols = piece_advice(((64,), (4,) * 128), ((1,) * 64, (512,)))
    assert cols == "longer input chunks along axis 1, or longer output chunks along axis 0"
    assert piece_advice(((4, 4),), ((4, 4),)) == "larger chunks"


def test_thin_held_rows_into_strips_warn_and_blocks_do_not() -> None:
    thin = rechunk_p2p.plan(_held((8192, 8192), (1, 8192)), (8192, 4))
    assert thin.n_pieces == 8192 * 2048 and thin.cost.dominant == "pieces"
    assert thin.warning is not None and "16,777,216 pieces of 32 B" in thin.warning
    assert "longer input chunks along axis 0" in repr(thin)
    assert "8,192 per output chunk, 32 B each" in repr(thin)
    blocks = rechunk_p2p.plan(_held((2048, 2048), (256, 2048)), (2048, 256))
    assert blocks.warning is None and "warning" not in repr(blocks)
    assert "8 per output chunk, 512.00 kiB each" in repr(blocks)


def test_the_ordering_counts_transfer_tasks_not_held_chunks() -> None:
    """Held chunks that share transfer tasks (each with a held task beside it) are no roots
    of the graph: the ordering's share counts the transfers."""
    plan = rechunk_p2p.plan(_held((8192, 512), (1, 512)), (8192, 4))
    assert plan.n_ordered == 8192 * 128
    shared = dataclasses.replace(plan, held_transfers=64)
    assert shared.n_ordered == 64 * 128 and shared.cost.pieces < plan.cost.pieces
