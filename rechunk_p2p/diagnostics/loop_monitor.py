"""Measure event-loop lag on every worker and the scheduler while a block of code runs.

Where it runs: the client (the caller's thread, or the client's event loop with an
asynchronous client). It only coordinates: the probes themselves run on each server's
event loop (:mod:`rechunk_p2p.diagnostics.loop_probe`), installed and removed with
``Client.run`` / ``Client.run_on_scheduler``; the arithmetic is pure
(:mod:`rechunk_p2p.diagnostics.loop_stats`).

Examples
--------
>>> with measure_event_loops(client) as probe:  # doctest: +SKIP
...     y.compute()
>>> print(probe.report)  # doctest: +SKIP
>>> probe.report.overall.p99_ms, probe.report.overall.max_ms  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
import uuid
from types import TracebackType
from typing import Any

from dask.utils import parse_timedelta

from rechunk_p2p.diagnostics import loop_probe
from rechunk_p2p.diagnostics.loop_stats import (
    DistributedSignals,
    LoopLagReport,
    build_report,
    causes_from_wire,
)
from rechunk_p2p.errors import ClusterError, RechunkInputError, RechunkTypeError

logger = logging.getLogger(__name__)

#: Samples a probe keeps per process, at most (about 7 minutes at the default interval)
MAX_SAMPLES = 200_000

#: Points kept per timeline in the report (the probe keeps up to ``max_samples``).
DEFAULT_TIMELINE_POINTS = 2000


def measure_event_loops(
    client: Any = None,
    interval: str | float = "5ms",
    *,
    include_scheduler: bool = True,
    max_samples: int | None = None,
    timeline_points: int = DEFAULT_TIMELINE_POINTS,
    capture_stacks: str | float | None = None,
) -> LoopLagMonitor:
    """Sample the event-loop lag of every worker and the scheduler while the block runs.

    While open, a callback runs every ``interval`` on each server's event loop and records
    how late it ran; distributed's own ``tick-duration`` metric and "Event loop was
    unresponsive" messages are collected beside it. On exit the probes are removed (also
    when the block raised) and ``.report`` holds a :class:`LoopLagReport`.

    Parameters
    ----------
    client
        A ``distributed.Client``; the current default client if ``None``. With an
        asynchronous client use ``async with``.
    interval
        Time between samples, a ``dask`` time string or seconds.
    include_scheduler
        Also probe the scheduler's loop.
    max_samples
        Cap on timeline points per process; default :data:`MAX_SAMPLES`.
        Counters, maximum and percentiles stay exact/bounded regardless of the cap.
    timeline_points
        Points kept per timeline in the report.
    capture_stacks
        A duration (e.g. ``"100ms"``): a watchdog thread in each process records the loop
        thread's stack whenever the loop has not run the probe for that long; the most
        frequent stacks appear in ``report.causes[address].stacks``. ``None`` (default): off.

    Returns
    -------
    LoopLagMonitor
        A context manager; its ``report`` attribute is set on exit.

    Examples
    --------
    >>> with measure_event_loops(client) as probe:  # doctest: +SKIP
    ...     y.compute()
    >>> probe.report.per_process[worker_address].stalls_over_200ms  # doctest: +SKIP
    0
    """
    if client is None:
        from distributed import default_client

        try:
            client = default_client()
        except ValueError as e:
            raise ClusterError(
                "measure_event_loops needs a distributed Client: pass one or create one first"
            ) from e
    interval_s = float(parse_timedelta(interval, default="s"))
    if not interval_s > 0:
        raise RechunkInputError(f"measure_event_loops: interval must be positive, got {interval!r}")
    if max_samples is None:
        max_samples = MAX_SAMPLES
    if max_samples < 2 or timeline_points < 2:
        raise RechunkInputError("measure_event_loops: max_samples and timeline_points must be >= 2")
    stack_threshold_s = (
        None if capture_stacks is None else float(parse_timedelta(capture_stacks, default="s"))
    )
    return LoopLagMonitor(
        client, interval_s, include_scheduler, max_samples, timeline_points, stack_threshold_s
    )


class LoopLagMonitor:
    """**Confined to its opener.** One measurement window, used from the thread (or, with an
    asynchronous client, the event loop) that opened it; with a synchronous client its
    coroutines run on the client's loop through ``client.sync``, one at a time, while the
    opener waits, so no two threads touch it at once.

    Created by :func:`measure_event_loops`. ``report`` is ``None`` until the window closes.
    """

    def __init__(
        self,
        client: Any,
        interval_s: float,
        include_scheduler: bool,
        max_samples: int,
        timeline_points: int,
        stack_threshold_s: float | None = None,
    ) -> None:
        self.client = client
        self.stack_threshold_s = stack_threshold_s
        self.interval_s = interval_s
        self.include_scheduler = include_scheduler
        self.max_samples = max_samples
        self.timeline_points = timeline_points
        self.token = uuid.uuid4().hex
        self.report: LoopLagReport | None = None
        self.workers: list[str] = []
        self._scheduler_started = False
        self._t0 = 0.0
        self._t0_mono = 0.0

    # -- synchronous client ----------------------------------------------------------
    def __enter__(self) -> LoopLagMonitor:
        if getattr(self.client, "asynchronous", False):
            raise RechunkTypeError(
                "measure_event_loops: this client is asynchronous; use `async with`"
            )
        self.client.sync(self._start)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish(lambda: self.client.sync(self._stop), failed=exc is not None)

    # -- asynchronous client ---------------------------------------------------------
    async def __aenter__(self) -> LoopLagMonitor:
        await self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            report = await self._stop()
        except Exception:
            if exc is None:
                raise
            logger.warning("measure_event_loops: could not read the probes", exc_info=True)
            return
        self.report = report

    def _finish(self, stop: Any, failed: bool) -> None:
        try:
            self.report = stop()
        except Exception:
            if not failed:
                raise
            # Do not mask the exception of the measured block.
            logger.warning("measure_event_loops: could not read the probes", exc_info=True)

    # -- coordination (runs on the client's event loop) ------------------------------
    async def _start(self) -> None:
        self._t0, self._t0_mono = time.time(), time.monotonic()
        options = {
            "interval_s": self.interval_s,
            "max_samples": self.max_samples,
            "t0_wall": self._t0,
            "stack_threshold_s": self.stack_threshold_s,
        }
        args = (self.token, options)
        try:
            if self.include_scheduler:
                try:
                    await self.client.run_on_scheduler(loop_probe.start_on_scheduler, *args)
                except Exception as e:
                    raise ClusterError(
                        f"measure_event_loops: could not start the loop probe on the scheduler "
                        f"({e!r}); rechunk_p2p must be importable there and on every worker"
                    ) from e
                self._scheduler_started = True
            started = await self.client.run(loop_probe.start_on_worker, *args, on_error="return")
            self.workers = sorted(a for a, r in started.items() if not isinstance(r, Exception))
            failed = {a: r for a, r in started.items() if isinstance(r, Exception)}
            if failed:
                raise ClusterError(
                    f"measure_event_loops: could not start the loop probe on {sorted(failed)}: "
                    f"{next(iter(failed.values()))!r}; rechunk_p2p must be importable on "
                    "every worker"
                )
        except BaseException:
            try:
                await self._stop()
            except Exception:
                logger.warning(
                    "measure_event_loops: cleanup after a failed start failed", exc_info=True
                )
            raise

    async def _stop(self) -> LoopLagReport:
        duration = time.monotonic() - self._t0_mono
        wires: dict[str, dict[str, Any]] = {}
        live: set[str] | None = None
        if self._scheduler_started:
            out = await self.client.run_on_scheduler(
                loop_probe.stop_on_scheduler, self.token, self.timeline_points
            )
            self._scheduler_started = False
            live = set(out["workers"])
            if out["wire"] is not None:
                wires[out["address"]] = out["wire"]
        targets = [w for w in self.workers if live is None or w in live]
        missing = [w for w in self.workers if w not in targets]
        if targets:
            got = await self.client.run(
                loop_probe.stop_on_worker,
                self.token,
                self.timeline_points,
                workers=targets,
                on_error="return",
            )
            for addr in targets:
                r = got.get(addr)
                if isinstance(r, dict):
                    wires[addr] = r
                else:
                    missing.append(addr)
        self.workers = []
        signals = {a: DistributedSignals(**w.pop("signals")) for a, w in wires.items()}
        causes = {a: causes_from_wire(w.pop("causes")) for a, w in wires.items()}
        return build_report(
            wires,
            signals,
            interval_ms=self.interval_s * 1000.0,
            duration_s=duration,
            timeline_points=self.timeline_points,
            missing=missing,
            causes=causes,
        )
