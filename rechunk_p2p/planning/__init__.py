"""Pure planning of a rechunk: per-axis mappings, partials, worker assignment, the plan.

Where it runs: pure (no asyncio, no distributed).
"""

from rechunk_p2p.planning.axes import AxisGroup, AxisPiece, axis_groups, axis_pieces
from rechunk_p2p.planning.partials import (
    Partial,
    assign_worker,
    memory_weights,
    proportional_blocks,
)
from rechunk_p2p.planning.plan import RechunkPlan, make_partials

__all__ = [
    "AxisGroup",
    "AxisPiece",
    "Partial",
    "RechunkPlan",
    "assign_worker",
    "axis_groups",
    "axis_pieces",
    "make_partials",
    "memory_weights",
    "proportional_blocks",
]
