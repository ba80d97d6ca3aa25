"""What a zarr rechunk did: the report :func:`~rechunk_p2p.integrations.zarr.rechunk_zarr`
returns, and the event-loop lag measured over the call.

Where it runs: the client (the caller's thread).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import distributed
from dask.utils import format_bytes, format_time

from rechunk_p2p.integrations.zarr_input import ArrayLayout


@dataclass(frozen=True)
class ZarrRechunkReport:
    """**Immutable.** What :func:`rechunk_zarr` did.

    Attributes
    ----------
    source, target : str
        Where the data came from and went.
    zarr_format : int
        Format of the target.
    arrays : tuple of ArrayLayout
        Every array written, with its new layout.
    seconds : float
        Wall time from creating the target to the last chunk written.
    statistics : dict
        Change in :func:`rechunk_p2p.api.cluster_statistics` over the call
        (``bytes_spilled``, ``bytes_sent``, ``bytes_received``, ``runs``, and the seconds
        per phase, ``seconds_cut`` ... ``seconds_assemble``).
    loop_lag : tuple, optional
        Event-loop lag over the call: ``(p99 ms, workers' max ms, workers, scheduler's max
        ms)``, the p99 of the scheduler and the workers together (the workers' maximum is
        what the dashboard page shows for the call's runs); ``None`` if it could not be
        measured.
    chunks_written : int
        Target chunks (or shards) written by the call.
    chunks_resumed : int
        Target chunks an interrupted run had written, kept by a ``resume``.
    """

    source: str
    target: str
    zarr_format: int
    arrays: tuple[ArrayLayout, ...]
    seconds: float
    statistics: Mapping[str, float] = field(default_factory=dict)
    loop_lag: tuple[float, float, int, float] | None = None
    chunks_written: int = 0
    chunks_resumed: int = 0

    @property
    def nbytes(self) -> int:
        """Uncompressed bytes of all arrays written."""
        return sum(a.nbytes for a in self.arrays)

    @property
    def throughput(self) -> float:
        """Uncompressed bytes per second."""
        return self.nbytes / self.seconds if self.seconds > 0 else float("nan")

    @property
    def bytes_spilled(self) -> int:
        """Bytes the engine buffered on the workers' disks during the call."""
        return int(self.statistics.get("bytes_spilled", 0))

    def __str__(self) -> str:
        n_copied = sum(not a.rechunked for a in self.arrays)
        lines = [
            f"rechunked {self.source} -> {self.target} (zarr format {self.zarr_format})",
            f"  arrays:     {len(self.arrays)} ({n_copied} copied in their own layout)",
            f"  bytes:      {format_bytes(self.nbytes)} uncompressed",
            f"  chunks:     {self.chunks_written} written"
            + (
                f", {self.chunks_resumed} kept from the interrupted run"
                if self.chunks_resumed
                else ""
            ),
            f"  time:       {format_time(self.seconds)}",
            f"  throughput: {format_bytes(int(self.throughput))}/s"
            if self.seconds > 0
            else "  throughput: n/a",
            f"  sent between workers: {format_bytes(int(self.statistics.get('bytes_sent', 0)))}",
            f"  spilled to disk:      {format_bytes(self.bytes_spilled)}",
            _lag_text(self.loop_lag),
        ]
        return "\n".join(lines)

    def _resumed_text(self) -> str:
        if not self.chunks_resumed:
            return ""
        return f", {self.chunks_resumed} kept from the interrupted run"

    def _repr_html_(self) -> str:
        """The report as tables: the totals, then one row per array (Jupyter)."""
        from rechunk_p2p.html_tables import table_html

        title, *summary = str(self).splitlines()
        cells = (line.partition(":") for line in summary)
        rows = [(label.strip(), value.strip()) for label, _, value in cells]
        arrays = [
            (a.name, a.chunks, a.shards or "", "rechunked" if a.rechunked else "copied")
            for a in self.arrays
        ]
        return table_html(title, rows, (("array", "chunks", "shards", "layout"), arrays))


@contextlib.contextmanager
def lag_probe(client: distributed.Client) -> Iterator[Any]:
    """Event-loop lag of every server while the block runs (``None`` if not measurable)."""
    from rechunk_p2p.integrations import event_loop_probe

    with contextlib.ExitStack() as stack:
        try:
            probe = stack.enter_context(event_loop_probe(client))
        except Exception as e:  # the lag is a nicety: never fail a rechunk over it
            warnings.warn(f"cannot measure event-loop lag: {e}", RuntimeWarning, stacklevel=3)
            probe = None
        yield probe


def lag_of(probe: Any) -> tuple[float, float, int, float] | None:
    """:attr:`ZarrRechunkReport.loop_lag` of a probe's report."""
    report = getattr(probe, "report", None)
    if report is None:
        return None
    workers = report.workers()
    worst = max((w.max_ms for w in workers.values()), default=0.0)
    others = [s.max_ms for a, s in report.per_process.items() if a not in workers]
    return (report.overall.p99_ms, worst, len(workers), max(others, default=0.0))


def _lag_text(lag: tuple[float, float, int, float] | None) -> str:
    if lag is None:
        return "  event-loop lag: not measured"
    p99, worst, workers, scheduler = lag
    return (
        f"  event-loop lag: p99 {p99:.1f} ms; max {worst:.1f} ms on {workers} workers, "
        f"{scheduler:.1f} ms on the scheduler"
    )
