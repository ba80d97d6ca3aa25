"""What a rechunk's time goes to, estimated from its plan: tasks, pieces and bytes.

Where it runs: pure (the client, when a plan is shown).

A P2P rechunk pays three kinds of cost, whatever engine runs it:

- **per task**: distributed's own work for each task (the scheduler's transitions and
  messages, the worker's bookkeeping around the task thread);
- **per piece** (an input chunk's part of an output chunk):
  cutting it, its header, placing it; and the scheduler ordering the graph before anything
  runs, which for a sub-shuffle takes time in proportion to its transfer tasks times its
  output chunks (``dask.order`` walks every output for every root of the graph, and a
  sub-shuffle's roots are its transfers, or a held task per worker before them);
- **per byte**: copies and the loopback network.

The unit costs are this project's measurements on its 2-core benchmark machine (see
docs/performance.md, "Cost model"); they are estimates of the order of magnitude, meant to say
which of the three dominates and what to change, not to predict seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Seconds of one task, scheduler and worker together.
SECONDS_PER_TASK = 1.0e-3
#: Seconds of one piece: the engine's cut, header and placement.
SECONDS_PER_PIECE = 0.3e-6
#: Seconds of the scheduler's ordering per transfer task and output chunk of a sub-shuffle.
SECONDS_PER_ORDERED_PAIR = 0.5e-6
#: Seconds of one byte shuffled: two memory copies and, for half of it, the loopback network.
SECONDS_PER_BYTE = 1.0 / 1.5e9
#: A piece smaller than this costs more in its own handling than in its bytes.
SMALL_PIECE_BYTES = int(SECONDS_PER_PIECE / SECONDS_PER_BYTE)


@dataclass(frozen=True)
class CostEstimate:
    """**Immutable.** Estimated seconds of one rechunk, summed over the cluster's threads."""

    tasks: float
    pieces: float
    bytes: float

    @property
    def total(self) -> float:
        return self.tasks + self.pieces + self.bytes

    @property
    def dominant(self) -> str:
        """``"tasks"``, ``"pieces"`` or ``"bytes"``: the largest share."""
        shares = {"tasks": self.tasks, "pieces": self.pieces, "bytes": self.bytes}
        return max(shares, key=shares.__getitem__)


def estimate(n_tasks: int, n_pieces: int, nbytes: int, n_ordered: int = 0) -> CostEstimate:
    """The estimate for a rechunk of ``n_tasks`` tasks and ``n_pieces`` pieces shuffling
    ``nbytes``, whose sub-shuffles have ``n_ordered`` pairs of a transfer task and an output
    chunk in all (counted with the pieces).

    >>> estimate(2, 1_000_000, 0).dominant
    'pieces'
    """
    pieces = n_pieces * SECONDS_PER_PIECE + n_ordered * SECONDS_PER_ORDERED_PAIR
    return CostEstimate(n_tasks * SECONDS_PER_TASK, pieces, nbytes * SECONDS_PER_BYTE)


def piece_advice(
    old_chunks: tuple[tuple[int, ...], ...], new_chunks: tuple[tuple[int, ...], ...]
) -> str:
    """What makes pieces larger: per axis, the side (input or output chunks) whose typical
    length bounds the pieces' length there, for the axes where pieces are shortest.

    >>> piece_advice(((1,) * 8, (8,)), ((8,), (2,) * 4))
    'longer input chunks along axis 0, or longer output chunks along axis 1'
    """
    limits = []
    for axis, (old, new) in enumerate(zip(old_chunks, new_chunks)):
        a, b = _typical(old), _typical(new)
        piece = min(a, b)
        if a == b:
            continue
        limits.append((piece / max(a, b), axis, "input" if a < b else "output"))
    limits.sort()
    parts = [f"longer {side} chunks along axis {axis}" for _, axis, side in limits[:2]]
    return ", or ".join(parts) if parts else "larger chunks"


def _typical(chunks: tuple[int, ...]) -> float:
    """A typical chunk length of an axis (the median of its non-empty chunks)."""
    lengths = sorted(c for c in chunks if c) or [0]
    return float(lengths[len(lengths) // 2]) if not math.isnan(lengths[0]) else 1.0
