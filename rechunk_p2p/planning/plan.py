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
from rechunk_p2p.planning.axes import Chunks, axis_groups, axis_pieces, element_bytes
from rechunk_p2p.planning.partials import Partial


def make_partials(old_chunks: Chunks, new_chunks: Chunks) -> tuple[Partial, ...]:
    """Decompose a rechunk into independent partials, in C order over the grid of partials.

    >>> [p.index for p in make_partials(((2, 2), (3,)), ((4,), (1, 2)))]
    [(0, 0)]
    >>> len(make_partials(((2, 2), (3,)), ((2, 2), (1, 2))))
    2
    """
    if len(old_chunks) != len(new_chunks):
        raise RechunkInputError(f"Chunks {old_chunks} and {new_chunks} have different dimensions")
    groups = [axis_groups(o, n) for o, n in zip(old_chunks, new_chunks)]
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


@dataclass(frozen=True)
class RechunkPlan:
    """**Immutable.** What a P2P rechunk will do, before it runs.

    Counts are exact; byte figures for the cluster (``bytes_moved``,
    ``per_worker_buffer_bytes``) are estimates for ``n_workers`` workers with inputs spread
    evenly over them. Object arrays are counted at 8 bytes an element.
    ``send_buffer_bytes`` is the rechunk's own bound on the shards a worker holds queued for
    sending (``rechunk-p2p.comm.run-buffer-bytes``; ``None``: the worker's limit alone).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    old_chunks: Chunks
    new_chunks: Chunks
    n_workers: int = 1
    source_chunks: Chunks | None = None
    unknown_axes: tuple[int, ...] = ()
    send_buffer_bytes: int | None = None

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

    @cached_property
    def partials(self) -> tuple[Partial, ...]:
        """The independent sub-shuffles."""
        return make_partials(self.old_chunks, self.new_chunks)

    @property
    def n_partials(self) -> int:
        return len(self.partials)

    @cached_property
    def n_shuffles(self) -> int:
        """Partials that need a P2P shuffle (the others are built by plain tasks)."""
        return sum(p.needs_shuffle for p in self.partials)

    @property
    def merged(self) -> bool:
        """Whether the array's chunks are merged (by plain tasks) before the shuffle."""
        return self.source_chunks is not None and self.source_chunks != self.old_chunks

    @property
    def n_input_chunks(self) -> int:
        """Chunks of the array before the rechunk."""
        return math.prod(len(c) for c in (self.source_chunks or self.old_chunks))

    @property
    def n_output_chunks(self) -> int:
        return math.prod(len(c) for c in self.new_chunks)

    @cached_property
    def n_shards(self) -> int:
        """Non-empty intersections of an input chunk with an output chunk."""
        return math.prod(len(axis_pieces(o, n)) for o, n in zip(self.old_chunks, self.new_chunks))

    @cached_property
    def n_tasks(self) -> int:
        """Tasks the graph holds: per shuffled partial one transfer per input, one barrier and
        one unpack per output; one task per output chunk elsewhere; one per merged input."""
        shuffled = [p for p in self.partials if p.needs_shuffle]
        merges = math.prod(len(c) for c in self.old_chunks) if self.merged else 0
        return self.n_output_chunks + sum(p.n_inputs for p in shuffled) + len(shuffled) + merges

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
                f"{_chunk_summary(self.source_chunks or self.old_chunks)} -> "
                f"{_chunk_summary(self.new_chunks)}",
            ),
        ]
        if self.merged and self.source_chunks is not None:
            merged = f"{_chunk_summary(self.source_chunks)} -> {_chunk_summary(self.old_chunks)}"
            rows.append(("merged", f"{merged} by plain tasks before the shuffle"))
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
                f"{self.n_input_chunks} -> {self.n_output_chunks} ({self.n_shards} pieces)",
            ),
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

    def __repr__(self) -> str:
        return "\n".join([self.title, *(f"  {k:<12} {v}" for k, v in self.rows())])

    def _repr_html_(self) -> str:
        """The plan as a table (Jupyter shows it in place of the repr)."""
        from rechunk_p2p.diagnostics.html import table_html

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
