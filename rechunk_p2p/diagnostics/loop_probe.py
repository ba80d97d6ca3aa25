"""The loop-lag probe that runs inside each worker and the scheduler.

Where it runs: event loop (of the worker or scheduler it is installed on). The functions
:func:`start_on_worker`, :func:`start_on_scheduler`, :func:`stop_on_worker` and
:func:`stop_on_scheduler` are plain (non-async) functions handed to ``Client.run`` /
``Client.run_on_scheduler``, which call them directly on the server's event loop; each does
O(1) work except the final summary, which is bounded by ``max_samples``.

A probe is a chain of ``loop.call_at`` callbacks, one every ``interval``: each records how
late it ran and schedules the next one ``interval`` after it actually ran, so one stall
shows up as one late sample. Beside it the probe reads distributed's own ``tick-duration``
metric of the server and counts the "Event loop was unresponsive" messages of the
``distributed.core`` logger through a logging filter installed for the window.

Probes live in the module-level registry ``_PROBES`` (keyed by window token and server
address) and the logging filter in ``_FILTER`` (reference counted, one per process); both
are empty again once every probe has been stopped.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from types import FrameType
from typing import Any

from rechunk_p2p.diagnostics import gc_pauses
from rechunk_p2p.diagnostics.loop_stats import LagAccumulator, summarise
from rechunk_p2p.diagnostics.stall_causes import CauseTracker, StallWatchdog
from rechunk_p2p.errors import ClusterError
from rechunk_p2p.spec import PLUGIN_NAME

logger = logging.getLogger(__name__)

_TICK_METRIC = "tick-duration"
#: ``Status`` names of a server that is going away; its probe then removes itself.
_SERVER_DONE = frozenset({"closing", "closed", "failed"})
_UNRESPONSIVE_PREFIX = "Event loop was unresponsive"

#: Running probes of this process: ``{(token, address): probe}``.
_PROBES: dict[tuple[str, str], _LoopProbe] = {}
#: The process's "unresponsive" counter while at least one probe runs.
_FILTER: _UnresponsiveFilter | None = None


class _UnresponsiveFilter(logging.Filter):
    """**Loop-confined.** Counts "Event loop was unresponsive" records of ``distributed.core``.

    Installed as a filter on the logger itself (so it sees every record the logger emits,
    whatever handlers exist). Records are attributed to the emitting server by finding the
    ``self`` of the ``Server._measure_tick`` frame that logged them, falling back to the
    server's class name. If the logger had to be lowered to INFO for the window, records
    that would not have been emitted before are swallowed here, so nothing else changes.
    """

    def __init__(self, log: logging.Logger) -> None:
        super().__init__()
        self.log = log
        self.users = 0
        self.counts: dict[Any, list[float]] = {}
        self._orig_level = log.level
        self._emit_from = log.getEffectiveLevel()
        if not log.isEnabledFor(logging.INFO):
            log.setLevel(logging.INFO)
        log.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_UNRESPONSIVE_PREFIX):
            args = record.args if isinstance(record.args, tuple) else ()
            value = args[1] if len(args) > 1 else 0.0
            duration = float(value) if isinstance(value, (int, float, str)) else 0.0
            key = _emitting_server() or (args[0] if args else "?")
            entry = self.counts.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] = max(entry[1], duration)
        return record.levelno >= self._emit_from

    def take(self, server: Any) -> tuple[int, float]:
        """Count and longest duration recorded for ``server`` (or its class name)."""
        n, longest = 0, 0.0
        for key in (id(server), type(server).__name__):
            if key in self.counts:
                n += int(self.counts[key][0])
                longest = max(longest, self.counts[key][1])
        return n, longest

    def remove(self) -> None:
        self.log.removeFilter(self)
        self.log.setLevel(self._orig_level)


def _emitting_server() -> int | None:
    """``id`` of the server whose ``_measure_tick`` is on the stack, if any."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        if frame.f_code.co_name == "_measure_tick" and "self" in frame.f_locals:
            return id(frame.f_locals["self"])
        frame = frame.f_back
    return None


def _acquire_filter() -> _UnresponsiveFilter:
    global _FILTER
    if _FILTER is None:
        _FILTER = _UnresponsiveFilter(logging.getLogger("distributed.core"))
    _FILTER.users += 1
    return _FILTER


def _release_filter() -> None:
    global _FILTER
    if _FILTER is not None:
        _FILTER.users -= 1
        if _FILTER.users <= 0:
            _FILTER.remove()
            _FILTER = None


class _LoopProbe:
    """**Loop-confined.** The sampling callback chain and tick bookkeeping of one server.

    Parameters
    ----------
    server
        The ``distributed`` server (worker or scheduler) being measured.
    interval_s
        Time between samples.
    max_samples
        Cap of timeline points kept (see :class:`LagAccumulator`).
    t0_wall
        The client's wall-clock time when the window opened; timelines are relative to it.
    stack_threshold_s
        Catch the loop thread's stack when it has not sampled for this long (``None``: off).
    """

    def __init__(
        self,
        server: Any,
        interval_s: float,
        max_samples: int,
        t0_wall: float,
        stack_threshold_s: float | None = None,
    ) -> None:
        self.server = server
        self.interval = interval_s
        self.acc = LagAccumulator(max_samples)
        self.causes = CauseTracker(interval_s)
        self.gc = gc_pauses.watch()
        self.loop = asyncio.get_running_loop()
        self.watchdog = (
            StallWatchdog(threading.get_ident(), stack_threshold_s) if stack_threshold_s else None
        )
        # Map loop time to seconds since the client opened the window.
        self.offset = (time.time() - t0_wall) - self.loop.time()
        self.started = self.loop.time()
        self.filter = _acquire_filter()
        self._ticks0 = getattr(server, "_tick_counter", 0)
        self._tick_total0 = _digest(server, "digests_total")
        self._tick_max_saved = _digest(server, "digests_max")
        if hasattr(server, "digests_max"):
            server.digests_max[_TICK_METRIC] = 0.0
        self._n_unresp0, _ = self.filter.take(server)
        self.due = self.loop.time() + interval_s
        self.handle: asyncio.TimerHandle | None = self.loop.call_at(self.due, self._sample)

    def _sample(self) -> None:
        if getattr(self.server.status, "name", "") in _SERVER_DONE:
            self._retire()
            return
        now = self.loop.time()
        lag_ms = max(0.0, now - self.due) * 1000.0
        self.acc.add(now + self.offset, lag_ms)
        self.causes.observe(lag_ms)
        window = _engine_window(self.server)
        if window is not None:  # (the runs' maxima on the dashboard: as fine as this)
            window.observe(lag_ms / 1000.0)
        if self.watchdog is not None:
            self.watchdog.beat()
        self.due = now + self.interval
        self.handle = self.loop.call_at(self.due, self._sample)

    def _retire(self) -> None:
        """The server closed under the probe: leave nothing behind (its data is lost)."""
        for key, probe in list(_PROBES.items()):
            if probe is self:
                del _PROBES[key]
        self.stop(timeline_points=2)

    def stop(self, timeline_points: int) -> dict[str, Any]:
        """Cancel the chain, restore distributed's metrics and return the wire summary."""
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        server = self.server
        ticks = getattr(server, "_tick_counter", 0) - self._ticks0
        tick_total = _digest(server, "digests_total") - self._tick_total0
        tick_max = _digest(server, "digests_max")
        if hasattr(server, "digests_max"):
            server.digests_max[_TICK_METRIC] = max(tick_max, self._tick_max_saved)
        n_unresp, longest = self.filter.take(server)
        _release_filter()
        stacks = self.watchdog.stop() if self.watchdog is not None else {}
        self.causes.close()
        gc_pauses.unwatch(self.gc)
        core = sys.modules.get("distributed.core")
        wire = summarise(self.acc, timeline_points, self.loop.time() - self.started)
        wire["signals"] = {
            "server_type": type(server).__name__,
            "ticks": int(ticks),
            "tick_mean_ms": 1000.0 * tick_total / ticks if ticks > 0 else 0.0,
            "tick_max_ms": 1000.0 * tick_max,
            "unresponsive_warnings": n_unresp - self._n_unresp0,
            "unresponsive_max_s": longest if n_unresp > self._n_unresp0 else 0.0,
            "tick_limit_s": float(getattr(core, "tick_maximum_delay", float("nan"))),
        }
        wire["causes"] = self.causes.wire(stacks) | self.gc.wire()
        return wire


def _engine_window(server: Any) -> Any:
    """The engine's loop-lag window of a worker (:class:`~rechunk_p2p.diagnostics.live.
    LoopLagWindow`), where its plugin is installed; else ``None``."""
    plugins = getattr(server, "plugins", None)
    plugin = plugins.get(PLUGIN_NAME) if isinstance(plugins, dict) else None
    heartbeat = getattr(plugin, "heartbeat", None)
    return getattr(heartbeat, "lag", None)


def _digest(server: Any, name: str) -> float:
    table = getattr(server, name, None)
    return float(table.get(_TICK_METRIC, 0.0)) if table is not None else 0.0


def _start(server: Any, token: str, options: dict[str, Any]) -> str:
    key = (token, server.address)
    if key in _PROBES:
        raise ClusterError(f"loop probe {token} already running on {server.address}")
    _PROBES[key] = _LoopProbe(server, **options)
    return server.address


def _stop(server: Any, token: str, timeline_points: int) -> dict[str, Any] | None:
    probe = _PROBES.pop((token, server.address), None)
    return None if probe is None else probe.stop(timeline_points)


def start_on_worker(token: str, options: dict[str, Any], dask_worker: Any = None) -> str:
    """Start a probe on this worker's loop (for ``Client.run``); returns the address.

    ``options`` are the keyword arguments of :class:`_LoopProbe` after ``server``.
    """
    return _start(dask_worker, token, options)


def start_on_scheduler(token: str, options: dict[str, Any], dask_scheduler: Any = None) -> str:
    """Start a probe on the scheduler's loop (for ``Client.run_on_scheduler``)."""
    return _start(dask_scheduler, token, options)


def stop_on_worker(
    token: str, timeline_points: int, dask_worker: Any = None
) -> dict[str, Any] | None:
    """Stop this worker's probe of window ``token``; ``None`` if it had none."""
    return _stop(dask_worker, token, timeline_points)


def stop_on_scheduler(
    token: str, timeline_points: int, dask_scheduler: Any = None
) -> dict[str, Any]:
    """Stop the scheduler's probe of window ``token`` and list the workers still connected."""
    return {
        "address": dask_scheduler.address,
        "wire": _stop(dask_scheduler, token, timeline_points),
        "workers": list(dask_scheduler.workers),
    }


def active_probes(dask_worker: Any = None, dask_scheduler: Any = None) -> dict[str, Any]:
    """What this process holds right now (for tests and debugging): probes and filter."""
    log = logging.getLogger("distributed.core")
    return {
        "probes": sorted(f"{t}|{a}" for t, a in _PROBES),
        "filter": _FILTER is not None,
        "logger_filters": sum(isinstance(f, _UnresponsiveFilter) for f in log.filters),
        "gc_callback": gc_pauses.installed(),
    }
