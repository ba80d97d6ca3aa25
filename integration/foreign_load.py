"""How busy the machine was with work other than the test's own processes.

Where it runs: the test process (client), around a measured window.

A loop-lag bound is a statement about the engine on a machine that runs the engine. On a
two-core laptop that also compiles, indexes or runs another test suite, the OS delays a
loop past any bound whatever the engine does: the adjusted lag subtracts the time the loop
thread waited for a CPU, but not a collection or a lock held by a thread that was itself
descheduled. So a window that breaks a bound while other work kept the machine busy is
measured again (:func:`measured_again`); where the machine stays that busy, the bounds are
widened by the share of it the other work took; and a failure says how busy the machine
was in each window.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil

#: Cores of other work on average over a window past which the window is measured again
BUSY_CORES = 0.25
#: Windows measured at most, the first included
ATTEMPTS = 3
#: Bounds are widened for other work at most this many times
MOST_WIDENING = 4.0

T = TypeVar("T")


@dataclass(frozen=True)
class Window:
    """**Immutable.** One measured window: its wall seconds and the cores of work outside
    this process and its children, on average."""

    seconds: float
    foreign_cores: float

    def __str__(self) -> str:
        return f"{self.seconds:.1f} s with {self.foreign_cores:.2f} cores of other work"

    def widening(self) -> float:
        """How much longer the test's work takes for the cores the other work took: the
        machine's cores over those left (at most :data:`MOST_WIDENING`)."""
        cores = psutil.cpu_count() or 1
        left = max(cores - self.foreign_cores, cores / MOST_WIDENING)
        return min(cores / left, MOST_WIDENING)


def _own_cpu() -> float:
    """CPU seconds of this process and its children (the test's cluster), as they are now."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # (gone meanwhile)
            total += sum(child.cpu_times()[:2])
    return total


def _busy_cpu() -> float:
    """CPU seconds the whole machine has been busy, as they are now."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def measure(work: Callable[[], T]) -> tuple[T, Window]:
    """Run ``work``; its result and how busy the machine was with other work meanwhile."""
    start, busy, own = time.perf_counter(), _busy_cpu(), _own_cpu()
    result = work()
    seconds = time.perf_counter() - start
    foreign = max((_busy_cpu() - busy) - (_own_cpu() - own), 0.0)
    return result, Window(seconds, foreign / max(seconds, 1e-9))


def measured_again(work: Callable[[], T], broken: Callable[[T, float], list[str]]) -> list[str]:
    """Run ``work`` and check it with ``broken(result, widening)`` (the bounds it breaks,
    each bound times ``widening``); while a window breaks a bound and the machine was busy
    with other work (more than :data:`BUSY_CORES`), measure again, :data:`ATTEMPTS` windows
    at most. When every window was busy, the last one is checked once more with its bounds
    widened by the share of the machine the other work took (:meth:`Window.widening`).
    The bounds still broken, each window named, or nothing."""
    notes: list[str] = []
    for attempt in range(1, ATTEMPTS + 1):
        result, window = measure(work)
        failures = broken(result, 1.0)
        if not failures:
            return []
        notes.append(f"window {attempt}: {window}; broke {len(failures)} bound(s)")
        if window.foreign_cores <= BUSY_CORES:
            return [*failures, *notes]
    widening = window.widening()
    widened = broken(result, widening)
    if not widened:
        print(f"bounds held x{widening:.1f}, widened for the other work: {'; '.join(notes)}")
        return []
    return [*widened, *notes, f"bounds widened x{widening:.1f} for the other work"]
