"""Prometheus metrics of the engine on every worker's and the scheduler's ``/metrics``.

Where it runs: the worker and scheduler processes: registered when their plugin starts,
read by distributed's ``/metrics`` handler (on that server's loop) from the counters the
plugins keep already, a lock and a few additions per scrape; nothing is measured for it.

distributed serves ``/metrics`` from ``prometheus_client``'s default registry when that
package is installed; without it nothing is registered. One collector per process serves
every plugin of the process (an in-process cluster has several), each labelled with its
worker's address.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from rechunk_p2p.diagnostics.live import LAG_BUCKETS

_lock = threading.Lock()
_plugins: weakref.WeakSet[Any] = weakref.WeakSet()
_schedulers: weakref.WeakSet[Any] = weakref.WeakSet()
_registered = False

#: The scheduler plugin's counters served as ``rechunk_p2p_scheduler_<name>_total``
_SCHEDULER_COUNTERS = {
    "runs_created": "Runs of sub-shuffles created",
    "restarts": "Runs restarted from scratch",
    "continuations": "Runs continued after a worker left or joined, or to remake outputs",
    "remade": "Outputs lost after assembly that continuations assembled again",
    "restarts_saved": "Workers that left a run without restarting it",
    "outputs_moved": "Outputs that continuations moved to another worker",
    "joined": "Workers that joined a run while its transfers ran",
    "inputs_resent": "Inputs whose every piece continuations sent again",
    "left": "Workers that left a run while it was open",
}


def register_worker(plugin: Any) -> bool:
    """Serve a worker plugin's counters on its process's ``/metrics``; whether
    ``prometheus_client`` is there to do it."""
    return _register(plugin, _plugins)


def register_scheduler(plugin: Any) -> bool:
    """Serve the scheduler plugin's counters on the scheduler's ``/metrics``."""
    return _register(plugin, _schedulers)


def _register(plugin: Any, into: weakref.WeakSet[Any]) -> bool:
    global _registered
    try:
        import prometheus_client
    except ImportError:
        return False
    with _lock:
        into.add(plugin)
        if not _registered:
            prometheus_client.REGISTRY.register(_EngineCollector())
            _registered = True
    return True


def error_type(exception_text: str) -> str:
    """The exception's type name in distributed's ``exception_text`` (``"Name(...)"``)."""
    name = exception_text.partition("(")[0].strip()
    return name if name.isidentifier() else "unknown"


def unregister_worker(plugin: Any) -> None:
    """Stop serving ``plugin``'s counters (its worker closes)."""
    with _lock:
        _plugins.discard(plugin)


class _EngineCollector:
    """A ``prometheus_client`` collector of every registered plugin's totals."""

    def describe(self) -> list:
        return []  # collected on demand: no names are reserved up front

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        with _lock:
            plugins = [p for p in _plugins if getattr(p, "worker", None) is not None]
            schedulers = [p for p in _schedulers if getattr(p, "scheduler", None) is not None]
        yield from _scheduler_families(schedulers)
        label = ["worker"]
        runs = CounterMetricFamily(
            "rechunk_p2p_runs", "Runs of a sub-shuffle on the worker, open or closed", labels=label
        )
        open_runs = GaugeMetricFamily(
            "rechunk_p2p_runs_open", "Runs open on the worker now", labels=label
        )
        byte_counters = {
            name: CounterMetricFamily(f"rechunk_p2p_{name}", help_text, labels=label)
            for name, help_text in (
                ("bytes_sent", "Piece bytes sent to other workers"),
                ("bytes_received", "Piece bytes received from other workers"),
                ("bytes_spilled", "Piece bytes written to the worker's local disk"),
            )
        }
        messages = CounterMetricFamily(
            "rechunk_p2p_messages_sent", "Batches of pieces sent to other workers", labels=label
        )
        phases = CounterMetricFamily(
            "rechunk_p2p_phase_seconds",
            "Seconds spent per phase, summed over the worker's threads",
            labels=["worker", "phase"],
        )
        queued = GaugeMetricFamily(
            "rechunk_p2p_max_bytes_queued",
            "Most bytes one run had queued for sending at once",
            labels=label,
        )
        queued_now = GaugeMetricFamily(
            "rechunk_p2p_bytes_queued",
            "Piece bytes waiting to be sent now (against comm.buffer-bytes-limit)",
            labels=label,
        )
        lag = HistogramMetricFamily(
            "rechunk_p2p_event_loop_lag_seconds",
            "How late a callback on the worker's event loop ran (sampled every 50 ms)",
            labels=label,
        )
        for plugin in plugins:
            address = str(plugin.worker.address)
            window = plugin.heartbeat.lag
            counts = list(itertools.accumulate(window.buckets))
            bounds = [*(str(b) for b in LAG_BUCKETS), "+Inf"]
            lag.add_metric([address], list(zip(bounds, counts)), window.total)
            totals = plugin.totals()
            runs.add_metric([address], totals.runs)
            open_runs.add_metric([address], len(plugin.run_statistics()))
            for name, family in byte_counters.items():
                family.add_metric([address], getattr(totals, name))
            messages.add_metric([address], totals.messages_sent)
            queued.add_metric([address], totals.max_bytes_queued)
            limiter = plugin.dataplane.limiter if plugin.dataplane is not None else None
            queued_now.add_metric([address], limiter.used if limiter is not None else 0)
            for phase in fields(totals.phases):
                phases.add_metric([address, phase.name], getattr(totals.phases, phase.name))
        yield runs
        yield open_runs
        yield from byte_counters.values()
        yield messages
        yield phases
        yield queued
        yield queued_now
        yield lag


def _scheduler_families(plugins: list[Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    label = ["scheduler"]
    active = GaugeMetricFamily(
        "rechunk_p2p_scheduler_runs_active", "Runs open on the scheduler now", labels=label
    )
    counters = {
        name: CounterMetricFamily(f"rechunk_p2p_scheduler_{name}", text, labels=label)
        for name, text in _SCHEDULER_COUNTERS.items()
    }
    errors = CounterMetricFamily(
        "rechunk_p2p_scheduler_task_errors",
        "Transfer and barrier tasks that failed, by the exception's type",
        labels=["scheduler", "type"],
    )
    for plugin in plugins:
        address = str(plugin.scheduler.address)
        active.add_metric([address], len(plugin.active))
        totals = {"runs_created": plugin.runs_created, **vars(plugin.recovery.counts)}
        for name, family in counters.items():
            family.add_metric([address], totals[name])
        for kind, count in sorted(plugin.errors.items()):
            errors.add_metric([address, kind], count)
    yield active
    yield from counters.values()
    yield errors
