"""What the engine's recent runs did, gathered from the workers: :func:`report`.

Where it runs: the client (one ``client.run`` round trip to every worker, which answer from
the counters they keep: the last runs they closed and the open ones).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from dask.utils import format_bytes

_PHASES = ("cut", "queue_wait", "send", "store", "assemble")


@dataclass(frozen=True)
class RunRow:
    """**Immutable.** One run of one sub-shuffle, over every worker that took part.

    ``phases`` are seconds summed over workers and threads; ``received`` is the bytes each
    worker received (its balance: how evenly the outputs were spread); ``open`` whether the
    run was still open on some worker.
    """

    shuffle_id: str
    run_id: int
    storage: str
    open: bool
    inputs: int
    outputs: int
    bytes_sent: int
    bytes_spilled: int
    phases: dict[str, float]
    received: dict[str, int]

    @property
    def balance(self) -> float:
        """Most bytes one worker received over the mean (1.0: perfectly even)."""
        values = list(self.received.values())
        mean = sum(values) / len(values) if values else 0
        return max(values) / mean if mean else 1.0


@dataclass(frozen=True)
class RunReport:
    """**Immutable.** The engine's recent runs on a cluster (oldest first); a table as text
    (``str``) and in notebooks (HTML)."""

    runs: tuple[RunRow, ...]

    _HEADER = ("rechunk", "run", "workers", "storage", "in", "out", "sent", "spilled")

    def _rows(self) -> list[tuple[str, ...]]:
        return [
            (
                r.shuffle_id + (" (open)" if r.open else ""),
                str(r.run_id),
                str(len(r.received)),
                r.storage,
                str(r.inputs),
                str(r.outputs),
                format_bytes(r.bytes_sent),
                format_bytes(r.bytes_spilled),
                *(f"{r.phases[p]:.2f}" for p in _PHASES),
                f"{r.balance:.2f}",
            )
            for r in self.runs
        ]

    def _header(self) -> tuple[str, ...]:
        return (*self._HEADER, *(f"{p} s" for p in _PHASES), "balance")

    def __str__(self) -> str:
        header, rows = self._header(), self._rows()
        if not rows:
            return "rechunk_p2p: no runs on this cluster yet"
        widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from rechunk_p2p.html_tables import table_html

        total = sum(r.bytes_sent for r in self.runs)
        summary = [("runs", str(len(self.runs))), ("sent between workers", format_bytes(total))]
        return table_html("rechunk_p2p runs", summary, (self._header(), self._rows()))


def report(client: Any = None) -> RunReport:
    """The engine's recent runs on the cluster of ``client`` (default: the current one):
    per run, its sub-shuffle, storage, inputs and outputs, bytes sent and spilled, seconds
    per phase summed over the workers, and how evenly the workers received.

    Each worker remembers the last 64 runs it closed and the ones still open. With an
    asynchronous client, await the result.
    """
    import distributed

    client = client or distributed.get_client()
    if getattr(client, "asynchronous", False):
        return _report_async(client)  # type: ignore[return-value]  # (awaited by the caller)
    return _report_of(client.run(_recent_runs))


async def _report_async(client: Any) -> RunReport:
    return _report_of(await client.run(_recent_runs))


def _report_of(per_worker: dict[str, list[dict]]) -> RunReport:
    """The report of what every worker answered (address -> its runs, as dicts)."""
    grouped: dict[tuple[str, int], list[tuple[str, dict]]] = defaultdict(list)
    for address, runs in sorted(per_worker.items()):
        for run in runs:
            grouped[run["shuffle_id"], run["run_id"]].append((address, run))
    rows = []
    for key in sorted(grouped, key=lambda k: (k[1], k[0])):
        parts = grouped[key]
        runs = [run for _, run in parts]
        rows.append(
            RunRow(
                shuffle_id=key[0],
                run_id=key[1],
                storage="/".join(sorted({r["storage"] for r in runs})),
                open=any(r["phase"] != "closed" for r in runs),
                inputs=sum(r["inputs"] for r in runs),
                outputs=sum(r["outputs"] for r in runs),
                bytes_sent=sum(r["bytes_sent"] for r in runs),
                bytes_spilled=sum(r["bytes_spilled"] for r in runs),
                phases={p: sum(r["phases"][p] for r in runs) for p in _PHASES},
                received={address: run["bytes_received"] for address, run in parts},
            )
        )
    return RunReport(tuple(rows))


def _recent_runs(dask_worker: Any) -> list[dict]:  # runs on each worker
    from rechunk_p2p.errors import ClusterError
    from rechunk_p2p.worker.plugin import get_plugin

    try:
        return [dataclasses.asdict(s) for s in get_plugin(dask_worker).recent_runs()]
    except ClusterError:
        return []
