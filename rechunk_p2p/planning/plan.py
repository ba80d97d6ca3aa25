"""The plan of a rechunk: its partials, and what running it will cost.

Where it runs: pure (no asyncio, no distributed).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from dask.utils import format_bytes

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.planning.axes import AxisGroup, Chunks, axis_groups, axis_pieces, element_bytes
from rechunk_p2p.planning.cost import CostEstimate, estimate, piece_advice
from rechunk_p2p.planning.groups import Groups, grouped_chunks
from rechunk_p2p.planning.partials import Partial


def make_partials(
    old_chunks: Chunks,
    new_chunks: Chunks,
    *,
    min_elements: int = 0,
    max_outputs: int = 0,
    fixed_axes: tuple[int, ...] = (),
) -> tuple[Partial, ...]:
    """Decompose a rechunk into independent partials, in C order over the grid of partials.

    With ``min_elements``, neighbouring partials that each need a shuffle are joined into
    one, box by box, until a partial holds about that many elements: every partial is one
    run of the shuffle (its own barrier and round trips to the scheduler), so thousands of
    tiny ones cost far more than their bytes. With ``max_outputs`` too, joining stops before
    a partial has more output chunks than that: when a run's barrier passes, the scheduler
    sends all of its output tasks at once, and each worker takes its share of that batch of
    task messages in one step of its event loop. Partials that need no shuffle (slices or
    concatenations, built by plain tasks) are never joined, and neither are ``fixed_axes``.

    >>> [p.index for p in make_partials(((2, 2), (3,)), ((4,), (1, 2)))]
    [(0, 0)]
    >>> len(make_partials(((2, 2), (3,)), ((2, 2), (1, 2))))
    2
    >>> many = ((1,) * 8, (2,) * 4), ((2,) * 4, (1,) * 8)  # 16 partials of 2 x 2 chunks
    >>> len(make_partials(*many)), len(make_partials(*many, min_elements=16))
    (16, 4)
    >>> len(make_partials(*many, min_elements=16, max_outputs=4))
    8
    """
    if len(old_chunks) != len(new_chunks):
        raise RechunkInputError(f"Chunks {old_chunks} and {new_chunks} have different dimensions")
    groups = [axis_groups(o, n) for o, n in zip(old_chunks, new_chunks)]
    if min_elements > 1 and _every_partial_shuffles(groups, old_chunks, new_chunks):
        groups = _joined(groups, old_chunks, min_elements, max_outputs, fixed_axes)
    partials = []
    for index in itertools.product(*(range(len(g)) for g in groups)):
        chosen = [g[i] for g, i in zip(groups, index)]
        partials.append(
            Partial(
                index=index,
                old_offset=tuple(g.old.start for g in chosen),
                new_offset=tuple(g.new.start for g in chosen),
                old_chunks=tuple(o[g.old.start : g.old.stop] for o, g in zip(old_chunks, chosen)),
                new_chunks=tuple(n[g.new.start : g.new.stop] for n, g in zip(new_chunks, chosen)),
            )
        )
    return tuple(partials)


def _every_partial_shuffles(
    groups: list[tuple[AxisGroup, ...]], old_chunks: Chunks, new_chunks: Chunks
) -> bool:
    """Whether every partial with elements needs a shuffle (more than one non-empty input
    chunk and more than one output chunk); decided per axis, without listing the partials."""
    inputs = [
        {sum(1 for k in g.old if old_chunks[a][k]) for g in axis} for a, axis in enumerate(groups)
    ]
    outputs = [{len(g.new) for g in axis} for axis in groups]
    return math.prod(min(n) for n in inputs) > 1 and math.prod(min(n) for n in outputs) > 1


def _joined(
    groups: list[tuple[AxisGroup, ...]],
    old_chunks: Chunks,
    min_elements: int,
    max_outputs: int,
    fixed_axes: tuple[int, ...],
) -> list[tuple[AxisGroup, ...]]:
    """Join neighbouring groups, from the last axis to the first, until a partial (the
    product of one group per axis) holds about ``min_elements`` elements, or would have more
    than ``max_outputs`` output chunks (0: no limit)."""
    lengths = [
        [sum(old_chunks[a][k] for k in g.old) for g in axis] for a, axis in enumerate(groups)
    ]
    typical = [max(axis) if axis else 0 for axis in lengths]
    outputs = [max((len(g.new) for g in axis), default=0) for axis in groups]
    out = list(groups)
    for axis in reversed(range(len(groups))):
        rest = math.prod(t for a, t in enumerate(typical) if a != axis)
        if axis in fixed_axes or rest == 0 or typical[axis] * rest >= min_elements:
            continue
        target = -(-min_elements // rest)  # elements along this axis per joined group
        # output chunks along this axis per joined group
        most = max_outputs // math.prod(max(n, 1) for a, n in enumerate(outputs) if a != axis)
        if max_outputs and most < 2:
            continue
        joined: list[AxisGroup] = []
        length = 0
        for group, n in zip(groups[axis], lengths[axis]):
            fits = not max_outputs or (joined and len(joined[-1].new) + len(group.new) <= most)
            if joined and length < target and fits:
                last = joined[-1]
                joined[-1] = AxisGroup(
                    range(last.old.start, group.old.stop), range(last.new.start, group.new.stop)
                )
                length += n
            else:
                joined.append(group)
                length = n
        out[axis] = tuple(joined)
        typical[axis] = max(sum(old_chunks[axis][k] for k in g.old) for g in joined)
        outputs[axis] = max(len(g.new) for g in joined)
        if math.prod(typical) >= min_elements:
            break
    return out


@dataclass(frozen=True)
class RechunkPlan:
    """**Immutable.** What a P2P rechunk will do, before it runs.

    Counts are exact; byte figures for the cluster (``bytes_moved``,
    ``per_worker_buffer_bytes``) are estimates for ``n_workers`` workers with inputs spread
    evenly over them. Object arrays are counted at 8 bytes an element.
    ``send_buffer_bytes`` is the rechunk's own bound on the pieces a worker holds queued for
    sending (``rechunk-p2p.comm.run-buffer-bytes``; ``None``: the worker's limit alone).
    ``partial_bytes``: independent sub-shuffles smaller than this are joined with their
    neighbours (``rechunk-p2p.partial-bytes``; 0: never; see :func:`make_partials`), but not
    past ``partial_outputs`` output chunks (:data:`rechunk_p2p.arrays.PARTIAL_OUTPUTS`;
    0: no limit).
    ``groups``: per axis, how many neighbouring input chunks each transfer task makes and
    cuts together (see :mod:`rechunk_p2p.planning.groups`); ``None``: one each. The shuffle's
    inputs (``input_chunks``, which partials and pieces count) are then those groups.
    ``held_transfers``: the transfer tasks of the shuffled partials where chunks held on one
    worker share them (:mod:`rechunk_p2p.holders`); ``None``: one per input. ``held_tasks``:
    the tasks that mark the chunks of those shared transfers, one per worker
    (``rechunk_p2p.tasks.held``).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    old_chunks: Chunks
    new_chunks: Chunks
    n_workers: int = 1
    unknown_axes: tuple[int, ...] = ()
    send_buffer_bytes: int | None = None
    partial_bytes: int = 0
    partial_outputs: int = 0
    groups: Groups | None = None
    held_transfers: int | None = None
    held_tasks: int = 0
    origin: str = ""  # where the input's chunks come from, and why (plan() sets it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if not (len(self.shape) == len(self.old_chunks) == len(self.new_chunks)):
            raise RechunkInputError(
                f"Shape {self.shape}, old chunks and new chunks have different dimensions"
            )
        for axis, (n, old, new) in enumerate(zip(self.shape, self.old_chunks, self.new_chunks)):
            if sum(old) != n or sum(new) != n:
                raise RechunkInputError(
                    f"Chunks along axis {axis} do not sum to its length {n}: {old} -> {new}"
                )
        if self.n_workers < 1:
            raise RechunkInputError(f"A plan needs at least one worker, got {self.n_workers}")
        if self.groups is not None and (
            len(self.groups) != len(self.old_chunks)
            or any(sum(g) != len(o) or 0 in g for g, o in zip(self.groups, self.old_chunks))
        ):
            raise RechunkInputError(
                f"Groups {self.groups} do not cover the input chunks {self.old_chunks}"
            )

    @cached_property
    def input_chunks(self) -> Chunks:
        """The chunks the shuffle cuts: the input's own, or the groups of them that each
        transfer task joins."""
        if self.groups is None:
            return self.old_chunks
        return tuple(grouped_chunks(o, g) for o, g in zip(self.old_chunks, self.groups))

    @cached_property
    def partials(self) -> tuple[Partial, ...]:
        """The independent sub-shuffles (small ones joined up to ``partial_bytes`` and
        ``partial_outputs``)."""
        return make_partials(
            self.input_chunks,
            self.new_chunks,
            min_elements=self.partial_bytes // self.itemsize,
            max_outputs=self.partial_outputs,
            fixed_axes=self.unknown_axes,
        )

    @property
    def n_partials(self) -> int:
        return len(self.partials)

    @cached_property
    def n_shuffles(self) -> int:
        """Partials that need a P2P shuffle (the others are built by plain tasks)."""
        return sum(p.needs_shuffle for p in self.partials)

    @property
    def n_input_chunks(self) -> int:
        """Chunks of the array before the rechunk."""
        return math.prod(len(c) for c in self.old_chunks)

    @property
    def n_output_chunks(self) -> int:
        return math.prod(len(c) for c in self.new_chunks)

    @property
    def n_transfers(self) -> int:
        """Input chunks as the shuffle cuts them: one transfer task each, where shuffled."""
        return math.prod(len(c) for c in self.input_chunks)

    @cached_property
    def n_pieces(self) -> int:
        """Non-empty intersections of a (joined) input chunk with an output chunk."""
        return math.prod(len(axis_pieces(o, n)) for o, n in zip(self.input_chunks, self.new_chunks))

    @cached_property
    def n_tasks(self) -> int:
        """Tasks the graph holds: per shuffled partial one transfer per input, one barrier and
        one unpack per output; one task per output chunk elsewhere, plus one per group of
        input chunks with elements those read when chunks are joined (held chunks: one held
        task per worker too)."""
        shuffled = [p for p in self.partials if p.needs_shuffle]
        joined = 0
        if self.groups is not None:
            joined = sum(p.n_nonempty_inputs for p in self.partials if not p.needs_shuffle)
        transfers = sum(p.n_inputs for p in shuffled)
        if self.held_transfers is not None:
            transfers = self.held_transfers + self.held_tasks
        return self.n_output_chunks + transfers + len(shuffled) + joined

    @property
    def itemsize(self) -> int:
        return element_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @cached_property
    def bytes_shuffled(self) -> int:
        """Bytes that go through a P2P shuffle."""
        return sum(p.size for p in self.partials if p.needs_shuffle) * self.itemsize

    @property
    def bytes_moved(self) -> int:
        """Estimated bytes that cross workers: all shuffled bytes but the local share."""
        return self.bytes_shuffled * (self.n_workers - 1) // max(self.n_workers, 1)

    @property
    def largest_output_chunk_bytes(self) -> int:
        return math.prod(max(c, default=0) for c in self.new_chunks) * self.itemsize

    @property
    def largest_input_chunk_bytes(self) -> int:
        return math.prod(max(c, default=0) for c in self.old_chunks) * self.itemsize

    @property
    def largest_cut_bytes(self) -> int:
        """Bytes of the largest chunk the shuffle cuts (a joined group's, where joined)."""
        return math.prod(max(c, default=0) for c in self.input_chunks) * self.itemsize

    @property
    def per_worker_buffer_bytes(self) -> int:
        """Estimated bytes each worker buffers (in memory or on disk) before unpacking."""
        return -(-self.bytes_shuffled // max(self.n_workers, 1))

    @property
    def title(self) -> str:
        return f"RechunkPlan<{self.shape} {self.dtype}, {format_bytes(self.nbytes)}>"

    def rows(self) -> list[tuple[str, str]]:
        """``(label, text)`` for each line of the summary (the repr and the HTML table)."""
        workers = f"{self.n_workers} worker{'s' * (self.n_workers != 1)}"
        queue = (
            ""
            if self.send_buffer_bytes is None
            else f", at most {format_bytes(self.send_buffer_bytes)} queued for sending"
        )
        rows = [
            ("engine", "rechunk_p2p (P2P shuffle)"),
            (
                "chunks",
                f"{_chunk_summary(self.old_chunks)} -> {_chunk_summary(self.new_chunks)}",
            ),
        ]
        if self.origin:
            rows.append(("input", self.origin))
        if self.unknown_axes:
            rows.append(
                (
                    "unknown",
                    f"axes {list(self.unknown_axes)} have unknown chunk sizes (kept as they "
                    "are; sizes count one element per chunk)",
                )
            )
        return [
            *rows,
            (
                "chunk count",
                f"{self.n_input_chunks} -> {self.n_output_chunks} ({self.n_pieces} pieces)",
            ),
            *self._group_rows(),
            *self._piece_rows(),
            ("partials", f"{self.n_partials} ({self.n_shuffles} shuffled)"),
            ("tasks", f"{self.n_tasks}"),
            (
                "shuffled",
                f"{format_bytes(self.bytes_shuffled)}; ~{format_bytes(self.bytes_moved)} "
                f"cross workers (estimate for {workers})",
            ),
            ("per worker", f"~{format_bytes(self.per_worker_buffer_bytes)} buffered{queue}"),
            (
                "largest",
                f"input chunk {format_bytes(self.largest_input_chunk_bytes)}, "
                f"output chunk {format_bytes(self.largest_output_chunk_bytes)}",
            ),
        ]

    @property
    def cost(self) -> CostEstimate:
        """Estimated seconds by kind of cost (see :mod:`rechunk_p2p.planning.cost`)."""
        return estimate(self.n_tasks, self.n_pieces, self.bytes_shuffled, self.n_ordered)

    @property
    def n_ordered(self) -> int:
        """Pairs of a root of the graph (a transfer task; where held chunks share transfers,
        a held task per worker) and an output chunk, summed over the shuffled partials (what
        the scheduler's ordering of the graph takes time in)."""
        roots = self.held_tasks or self.held_transfers
        return sum(
            min(p.n_inputs, roots or p.n_inputs) * p.n_outputs
            for p in self.partials
            if p.needs_shuffle
        )

    @property
    def warning(self) -> str | None:
        """One line when per-piece cost dominates the estimate, naming what helps."""
        cost = self.cost
        if cost.dominant != "pieces" or self.n_pieces == 0:
            return None
        size = format_bytes(self.bytes_shuffled // self.n_pieces)
        return (
            f"per-piece cost dominates ({self.n_pieces:,} pieces of {size} on average): "
            f"{piece_advice(self.input_chunks, self.new_chunks)} make fewer, larger pieces"
        )

    def _piece_rows(self) -> list[tuple[str, str]]:
        if not self.n_pieces:
            return []
        cost = self.cost
        per_output = self.n_pieces / max(self.n_output_chunks, 1)
        rows = [
            (
                "pieces",
                f"{per_output:,.0f} per output chunk, "
                f"{format_bytes(self.bytes_shuffled // self.n_pieces)} each on average",
            ),
            (
                "cost",
                f"~{cost.total:.1f} s of CPU estimated: tasks {cost.tasks:.1f} s, pieces "
                f"{cost.pieces:.1f} s, bytes {cost.bytes:.1f} s",
            ),
        ]
        warning = self.warning
        return [*rows, ("warning", warning)] if warning else rows

    def _group_rows(self) -> list[tuple[str, str]]:
        rows = []
        if self.groups is not None:
            most = math.prod(max(g, default=1) for g in self.groups)
            how = "held on one worker" if self.held_transfers is not None else "made"
            rows.append(
                (
                    "joined",
                    f"{self.n_transfers} groups of up to {most} input chunks, each {how} "
                    "and cut as one block",
                )
            )
        if self.held_transfers is not None:
            rows.append(
                ("held", f"{self.held_transfers} transfer tasks cut the chunks on a worker")
            )
        return rows

    def __repr__(self) -> str:
        return "\n".join([self.title, *(f"  {k:<12} {v}" for k, v in self.rows())])

    def _repr_html_(self) -> str:
        """The plan as a table (Jupyter shows it in place of the repr)."""
        from rechunk_p2p.html_tables import table_html

        return table_html(self.title, self.rows())


def _chunk_summary(chunks: Chunks) -> str:
    """Chunk sizes in one line: the first chunk per axis, marked when the axis is irregular."""
    parts = []
    for axis in chunks:
        if not axis:
            parts.append("0")
            continue
        regular = len(set(axis[:-1])) <= 1 and axis[-1] <= axis[0]
        parts.append(f"{axis[0]}" if regular else f"{max(axis)}~")
    return "(" + ", ".join(parts) + ")"
