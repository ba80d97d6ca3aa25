"""The engine's runs and workers as the scheduler sees them now: what the dashboard shows.

Where it runs: the scheduler's event loop (a dashboard page's periodic callback, or a
performance report). It reads the scheduler plugin's open and recently finished runs, the
states of their tasks, and what each worker's last heartbeat carried
(:mod:`rechunk_p2p.diagnostics.live`); nothing is asked of any worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rechunk_p2p.diagnostics.live import METRIC
from rechunk_p2p.spec import ShuffleId, barrier_key

#: How long a finished run stays listed
FINISHED_SECONDS = 600.0
#: A worker whose last heartbeat is older than this is shown as silent
SILENT_SECONDS = 5.0

#: Task states in which a transfer or output is done
_DONE = frozenset({"memory"})
#: What a run's row sums over its workers' heartbeats
_BYTES = ("bytes_sent", "bytes_received", "bytes_buffered", "bytes_spilled", "workers")
#: Finished runs the scheduler plugin remembers
FINISHED_KEPT = 64


@dataclass(frozen=True)
class FinishedRun:
    """**Immutable.** A run the scheduler closed: when, and why."""

    shuffle_id: str
    run_id: int
    reason: str
    started: float
    finished: float
    transfers: int
    outputs: int
    name: str = ""  # the input's name (ShuffleSpec.label)
    workers: int = 0  # the run's workers as it closed
    bytes_sent: int = 0  # from its workers' last heartbeats
    bytes_received: int = 0
    loop_max_ms: float = 0.0
    changes: str = ""  # how its workers changed (SchedulerRun.changes)


@dataclass(frozen=True)
class RunRow:
    """**Immutable.** One run on the dashboard: its phase, progress and bytes.

    ``phase``: ``transfers`` (pieces being cut and sent), ``assembling`` (the barrier passed:
    every piece arrived, outputs being assembled), ``done``, or why it stopped otherwise.
    Bytes are summed over the workers' last heartbeats.
    """

    shuffle_id: str
    run_id: int
    phase: str
    transfers_done: int
    transfers: int
    outputs_done: int
    outputs: int
    bytes_sent: int
    bytes_received: int
    bytes_memory: int
    bytes_disk: int
    workers: int
    seconds: float
    name: str = ""  # the input's name (ShuffleSpec.label): the array or variable
    loop_max_ms: float = 0.0  # the most lag of its workers' loops while it was open there
    changes: str = ""  # workers joined and left, outputs moved (SchedulerRun.changes)

    @property
    def label(self) -> str:
        """Short name: the input's name, the rechunk's token abridged, its partial, the run
        (the name tells the user's arrays apart, the rest the runs)."""
        token, _, partial = self.shuffle_id.partition("-")
        ident = f"{token[:8]}{'-' if partial else ''}{partial}/{self.run_id}"
        return f"{self.name} {ident}" if self.name else ident


@dataclass(frozen=True)
class WorkerRow:
    """**Immutable.** One worker on the dashboard: its runs' bytes against its limits and
    its event loop's recent lag (from its last heartbeat)."""

    address: str
    bytes_sent: int
    bytes_received: int
    bytes_memory: int
    bytes_disk: int
    bytes_queued: int
    buffer_limit: int
    memory_budget: int
    lag_p99_ms: float
    lag_max_ms: float
    silent: bool


@dataclass(frozen=True)
class LiveView:
    """**Immutable.** Every open and recently finished run, newest first, and every worker."""

    runs: tuple[RunRow, ...]
    workers: tuple[WorkerRow, ...]


def finished_run(scheduler: Any, run: Any, reason: str) -> FinishedRun:
    """What to remember of ``run`` (a :class:`~rechunk_p2p.recovery.SchedulerRun`) as it
    closes."""
    transfers, _, outputs, _ = _progress(scheduler, run.shuffle_id)
    totals = _bytes_per_run(_beats(scheduler)).get((run.shuffle_id, run.run_spec.run_id), {})
    return FinishedRun(
        run.shuffle_id,
        run.run_spec.run_id,
        reason,
        run.started,
        time.time(),
        transfers,
        outputs,
        run.run_spec.spec.label,
        len(run.workers),
        totals.get("bytes_sent", 0),
        totals.get("bytes_received", 0),
        totals.get("loop_max_ms", 0.0),
        run.changes,
    )


def live_view(scheduler: Any, plugin: Any, since: float | None = None) -> LiveView:
    """The runs of ``plugin`` (the scheduler plugin) and the workers of ``scheduler`` now;
    ``since``: only the runs that finished after that time (default: the last
    :data:`FINISHED_SECONDS`)."""
    now = time.time()
    since = now - FINISHED_SECONDS if since is None else since
    beats = _beats(scheduler)
    per_run = _bytes_per_run(beats)
    rows = [_open_row(scheduler, run, per_run, now) for run in plugin.active.values()]
    rows.sort(key=lambda r: -r.seconds)
    done = [_finished_row(f, per_run) for f in reversed(plugin.finished) if f.finished >= since]
    workers = tuple(_worker_row(addr, beat, now) for addr, beat in sorted(beats.items()))
    return LiveView(tuple(rows + done), workers)


def _beats(scheduler: Any) -> dict[str, dict]:
    """The engine's part of each worker's last heartbeat, by address."""
    return {addr: ws.metrics.get(METRIC) or {} for addr, ws in scheduler.workers.items()}


def _progress(scheduler: Any, shuffle_id: ShuffleId) -> tuple[int, int, int, int]:
    """Transfers and outputs of a sub-shuffle: total and done each, from its barrier."""
    barrier = scheduler.tasks.get(barrier_key(shuffle_id))
    if barrier is None:
        return 0, 0, 0, 0
    transfers = barrier.dependencies
    outputs = barrier.dependents
    passed = barrier.state == "memory"
    transfers_done = len(transfers) if passed else sum(t.state in _DONE for t in transfers)
    outputs_done = sum(t.state in _DONE for t in outputs)
    return len(transfers), transfers_done, len(outputs), outputs_done


def _bytes_per_run(beats: dict[str, dict]) -> dict[tuple[str, int], dict[str, Any]]:
    """``{(shuffle id, run id): {bytes_*: sum over workers, "workers": n, "loop_max_ms":
    the most over workers}}``."""
    out: dict[tuple[str, int], dict[str, int]] = {}
    for beat in beats.values():
        for row in [*beat.get("runs", ()), *beat.get("closed", ())]:
            total = out.setdefault((row["shuffle_id"], row["run_id"]), dict.fromkeys(_BYTES, 0))
            for name in _BYTES:
                total[name] += row[name] if name != "workers" else 1
            total["loop_max_ms"] = max(total.get("loop_max_ms", 0.0), row.get("loop_max_ms", 0))
    return out


def _open_row(scheduler: Any, run: Any, per_run: dict, now: float) -> RunRow:
    transfers, transfers_done, outputs, outputs_done = _progress(scheduler, run.shuffle_id)
    barrier = scheduler.tasks.get(barrier_key(run.shuffle_id))
    phase = "assembling" if barrier is not None and barrier.state == "memory" else "transfers"
    totals = per_run.get((run.shuffle_id, run.run_spec.run_id)) or dict.fromkeys(_BYTES, 0)
    return RunRow(
        run.shuffle_id,
        run.run_spec.run_id,
        phase,
        transfers_done,
        transfers,
        outputs_done,
        outputs,
        totals["bytes_sent"],
        totals["bytes_received"],
        totals["bytes_buffered"],
        totals["bytes_spilled"],
        max(totals["workers"], len(run.workers)),
        now - run.started,
        run.run_spec.spec.label,
        totals.get("loop_max_ms", 0.0),
        run.changes,
    )


def _finished_row(f: FinishedRun, per_run: dict) -> RunRow:
    """A closed run: done, or cut short and why (a worker left, its barrier failed), with
    the workers and bytes it had as it closed where the heartbeats no longer tell them."""
    totals = per_run.get((f.shuffle_id, f.run_id)) or dict.fromkeys(_BYTES, 0)
    phase = "done" if f.reason == "barrier released" else f"cut short: {f.reason}"
    return RunRow(
        f.shuffle_id,
        f.run_id,
        phase,
        f.transfers,
        f.transfers,
        f.outputs,
        f.outputs,
        max(totals["bytes_sent"], f.bytes_sent),
        max(totals["bytes_received"], f.bytes_received),
        0,  # a closed run holds nothing
        0,
        max(totals["workers"], f.workers),
        f.finished - f.started,
        f.name,
        max(totals.get("loop_max_ms", 0.0), f.loop_max_ms),
        f.changes,
    )


def _worker_row(address: str, beat: dict, now: float) -> WorkerRow:
    runs = beat.get("runs", ())
    lag = beat.get("lag", {})
    return WorkerRow(
        address,
        sum(r["bytes_sent"] for r in runs),
        sum(r["bytes_received"] for r in runs),
        sum(r["bytes_buffered"] for r in runs),
        sum(r["bytes_spilled"] for r in runs),
        int(beat.get("bytes_queued", 0)),
        int(beat.get("buffer_limit", 0)),
        int(beat.get("memory_budget", 0)),
        float(lag.get("p99_ms", 0.0)),
        float(lag.get("max_ms", 0.0)),
        not beat or now - float(beat.get("time", 0.0)) > SILENT_SECONDS,
    )
