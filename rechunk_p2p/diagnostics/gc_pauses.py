"""Garbage-collection pauses of the process, timed while a loop probe runs.

Where it runs: in whichever thread triggers a collection (``gc.callbacks`` run with the GIL
held, at the start and end of every collection); installed and removed on the event loop
by the probe. One callback per process, reference counted; each probe reads its own
counters.

A collection holds the GIL for its whole duration: every thread of the process, the
event loop included, is stopped meanwhile. Many small Python objects alive at once make
the (generation 2) collections long.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """**Thread-safe (guarded by the GIL and the collector).** Counters of one probe.

    Written only by the process's GC callback, in whichever thread triggered the collection
    (the collector runs one collection at a time, with the GIL held), and read by the probe on
    its loop; each update is a single attribute store, so a reader sees every field whole.
    """

    __slots__ = ("collections", "full_collections", "max_ms", "total_ms")

    def __init__(self) -> None:
        self.collections = 0
        self.full_collections = 0
        self.total_ms = 0.0
        self.max_ms = 0.0

    def wire(self) -> dict[str, Any]:
        return {
            "gc_collections": self.collections,
            "gc_full_collections": self.full_collections,
            "gc_pause_ms": self.total_ms,
            "gc_max_pause_ms": self.max_ms,
        }


class _GcTimer:
    """**Thread-safe (guarded by the GIL and the collector).** The one ``gc.callbacks`` entry of
    the process, fanning out to probes: called in any thread that triggers a collection, never
    twice at once; ``listeners`` is changed by probes on their loop (list appends/removes are
    atomic under the GIL)."""

    def __init__(self) -> None:
        self.listeners: list[GcPauses] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1000.0
        full = info.get("generation") == 2
        for p in self.listeners:
            p.collections += 1
            p.full_collections += full
            p.total_ms += ms
            if ms > p.max_ms:
                p.max_ms = ms

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


_TIMER: _GcTimer | None = None


def watch() -> GcPauses:
    """Start counting GC pauses for one probe (installs the process's callback if needed)."""
    global _TIMER
    if _TIMER is None:
        _TIMER = _GcTimer()
    pauses = GcPauses()
    _TIMER.listeners.append(pauses)
    return pauses


def unwatch(pauses: GcPauses) -> None:
    """Stop counting for one probe; the callback goes with the last one."""
    global _TIMER
    if _TIMER is None:
        return
    if pauses in _TIMER.listeners:
        _TIMER.listeners.remove(pauses)
    if not _TIMER.listeners:
        _TIMER.remove()
        _TIMER = None


def installed() -> bool:
    """Whether this process currently has the callback (for tests)."""
    return _TIMER is not None
