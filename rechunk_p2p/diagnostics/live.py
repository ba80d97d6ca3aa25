"""What a worker tells the scheduler about its runs with every heartbeat.

Where it runs: the worker's event loop and one thread of its own. :class:`LoopLagWindow` is
a chain of ``loop.call_at`` callbacks (one every :data:`LAG_INTERVAL`) that records how late
each ran. The numbers travel as one of the worker's custom metrics (``Worker.metrics``,
distributed's public hook), which the worker awaits when it sends a heartbeat, so they reach
the scheduler with no message of their own: the loop summarises its lag (200 samples) and
:func:`heartbeat_blocking` reads the runs' counters in the ``rechunk-p2p-heartbeat`` thread,
since those take the locks that piece writes hold (the loop must never wait on them).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict, deque
from typing import Any

from rechunk_p2p.offload import OffloadPool

#: The name under which a worker's heartbeat carries the engine's numbers
#: (``WorkerState.metrics[METRIC]`` on the scheduler)
METRIC = "rechunk_p2p"
#: Time between two samples of a worker's loop lag: a stall shows as up to this much
#: shorter than it was. (Every 10 ms cost an idle worker 2.6 % of a core, every 50 ms
#: 0.2 %; while a probe measures the loop for an end-of-run summary, its samples, every
#: 5 ms, count in the runs' maxima too: :meth:`LoopLagWindow.observe`.)
LAG_INTERVAL = 0.05
#: Samples kept for the recent lag (10 s at the interval)
LAG_SAMPLES = 200
#: Closed runs whose loop maximum the window keeps (more than a heartbeat repeats)
CLOSED_PEAKS = 16
#: Upper bounds (seconds) of the loop-lag histogram served on ``/metrics``
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Closed runs a heartbeat repeats (their totals stay listed on the dashboard)
CLOSED_IN_HEARTBEAT = 8

_RUN_FIELDS = (
    "shuffle_id",
    "run_id",
    "phase",
    "storage",
    "inputs",
    "outputs",
    "bytes_sent",
    "bytes_received",
    "bytes_buffered",
    "bytes_spilled",
)


class LoopLagWindow:
    """**Loop-confined.** How late a callback chain ran on one event loop, recently and in
    all.

    Keeps the last :data:`LAG_SAMPLES` lags (for the dashboard's p99 and max), a
    cumulative histogram over :data:`LAG_BUCKETS` (for Prometheus), and the most lag since
    each open run opened (and of the last :data:`CLOSED_PEAKS` closed), by shuffle id. A
    stall shows as one late sample: the next one is due an interval after a sample ran.
    """

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._peaks: OrderedDict[str, float] = OrderedDict()  # shuffle id -> seconds
        self._open: set[str] = set()
        self.buckets = [0] * (len(LAG_BUCKETS) + 1)  # the last counts the ones above all
        self.total = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start sampling the running loop."""
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + LAG_INTERVAL
        self._handle = self._loop.call_at(self._due, self._sample)

    def stop(self) -> None:
        """Stop sampling (the samples taken stay)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _sample(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.add(max(0.0, now - self._due))
        self._due = now + LAG_INTERVAL
        self._handle = self._loop.call_at(self._due, self._sample)

    def open_run(self, shuffle_id: str) -> None:
        """A run of ``shuffle_id`` opened here: its loop maximum counts from now (a run
        that continues or restarts one keeps counting)."""
        self._open.add(shuffle_id)
        self._peaks.setdefault(shuffle_id, 0.0)

    def close_run(self, shuffle_id: str) -> None:
        """The run of ``shuffle_id`` closed here: its maximum stays as it is."""
        self._open.discard(shuffle_id)
        self._peaks.move_to_end(shuffle_id)
        closed = [k for k in self._peaks if k not in self._open]
        for key in closed[: max(len(closed) - CLOSED_PEAKS, 0)]:
            del self._peaks[key]

    def peaks_ms(self) -> dict[str, float]:
        """The most lag of each run's time here, in milliseconds, by shuffle id."""
        return {key: 1000.0 * lag for key, lag in self._peaks.items()}

    def observe(self, lag: float) -> None:
        """A sample of ``lag`` seconds of this loop, taken by this window or by another
        probe of the same loop: it counts in the open runs' maxima."""
        for key in self._open:
            if lag > self._peaks[key]:
                self._peaks[key] = lag

    def add(self, lag: float) -> None:
        """Count one sample of ``lag`` seconds."""
        self.recent.append(lag)
        self.observe(lag)
        self.buckets[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        self.total += lag

    def summary(self) -> dict[str, float]:
        """p99 and max of the recent samples, in milliseconds."""
        if not self.recent:
            return {"p99_ms": 0.0, "max_ms": 0.0}
        ordered = sorted(self.recent)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return {"p99_ms": 1000.0 * p99, "max_ms": 1000.0 * ordered[-1]}


def heartbeat_blocking(
    plugin: Any, lag: dict[str, float], peaks: dict[str, float] | None = None
) -> dict[str, Any]:
    """The engine's numbers of ``plugin``'s worker for its next heartbeat: every open run
    and the last closed ones (bytes sent, received, in memory, on disk, the most loop lag
    of its time here from ``peaks``), the limits those bytes count against, and ``lag``,
    the worker loop's recent lag."""
    peaks = peaks or {}
    open_runs = [_run_row(s, peaks) for s in plugin.run_statistics()]
    closed = [_run_row(s, peaks) for s in plugin.closed_runs()[-CLOSED_IN_HEARTBEAT:]]
    worker = plugin.worker
    limiter = plugin.dataplane.limiter if plugin.dataplane is not None else None
    return {
        "time": time.time(),
        "runs": open_runs,
        "closed": closed,
        "lag": lag,
        "memory_budget": _memory_budget(worker),
        "buffer_limit": limiter.limit if limiter is not None else 0,
        "bytes_queued": limiter.used if limiter is not None else 0,
    }


def _memory_budget(worker: Any) -> int:
    """The bytes of pieces the worker keeps in memory before storage ``auto`` spills:
    ``storage-memory-fraction`` of its memory limit (0: no limit)."""
    from rechunk_p2p.settings import WorkerSettings

    limit = getattr(worker.memory_manager, "memory_limit", 0) or 0
    return int(WorkerSettings.read().memory_budget(limit) or 0)


def _run_row(stats: Any, peaks: dict[str, float]) -> dict[str, Any]:
    row = {name: getattr(stats, name) for name in _RUN_FIELDS}
    row["loop_max_ms"] = peaks.get(stats.shuffle_id, 0.0)
    return row


def _silent(worker: Any) -> dict[str, Any]:
    """The heartbeat entry of a worker whose plugin is gone: nothing to report."""
    return {}


class Heartbeat:
    """**Loop-confined.** The engine's part of a worker's heartbeats: a lag window on the
    worker's loop and the thread that reads the runs' counters.

    ``install`` and ``uninstall`` run on the worker's loop, in the plugin's setup and
    teardown.
    """

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.lag = LoopLagWindow()
        self._pool: OffloadPool | None = None

    def install(self, worker: Any) -> None:
        self._pool = OffloadPool(1, name="rechunk-p2p-heartbeat")
        self.lag.start()
        worker.metrics[METRIC] = self._beat

    def uninstall(self, worker: Any) -> None:
        # replaced, not removed: a heartbeat may be iterating ``worker.metrics`` while it
        # awaits this beat, and a dict that changes size under it fails the heartbeat (a
        # plugin registered again replaces this entry in turn)
        worker.metrics[METRIC] = _silent
        self.lag.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    async def _beat(self, worker: Any) -> dict[str, Any]:
        assert self._pool is not None
        lag, peaks = self.lag.summary(), self.lag.peaks_ms()
        return await self._pool.to_thread(heartbeat_blocking, self.plugin, lag, peaks)
