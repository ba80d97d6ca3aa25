"""Why was the loop late? CPU of the loop thread, run-queue wait, and stacks during stalls.

Where it runs: event loop (``CauseTracker.observe`` is called from the probe's callback on
the measured loop) and one daemon thread per probe (``StallWatchdog``, only when stack
capture is asked for). The arithmetic of the summaries is pure.

For each late interval the tracker splits the time between two samples into

* **loop CPU**: CPU time the loop thread itself used (``time.thread_time``): code running on
  the loop, the thing rechunk_p2p promises to avoid;
* **run-queue wait**: time the loop thread was runnable but not given a CPU by the OS
  (Linux ``/proc/thread-self/schedstat``): machine contention, not the code's fault;
* **other**: neither, i.e. waiting for the GIL held by another thread, or blocked in a
  system call (disk I/O, a lock, ``time.sleep``) on the loop.

The *contention-adjusted* lag of a sample is its lag minus the run-queue wait of the
interval: what the lag would have been on an idle machine, to first order.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

from rechunk_p2p.diagnostics.loop_stats import LagAccumulator

#: A sample this late (ms) counts as a stall for attribution.
ATTRIBUTION_THRESHOLD_MS = 50.0
#: Distinct stacks kept per probe.
MAX_STACKS = 32


class _SchedStat:
    """**Loop-confined.** Reads the run-queue wait of the thread that created it (Linux)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def wait_s(self) -> float:
        if self._fd is None:
            return float("nan")
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) * 1e-9
        except (OSError, ValueError, IndexError):
            return float("nan")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CauseTracker:
    """**Loop-confined.** Per-interval CPU and run-queue bookkeeping of one probe.

    Parameters
    ----------
    interval_s
        The probe interval (subtracted as normal idle time of each interval).
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._sched = _SchedStat()
        self.adjusted = LagAccumulator(max_samples=2, timeline=False)
        self.stall_ms = 0.0
        self.cpu_ms = 0.0
        self.runqueue_ms = 0.0
        self._cpu = time.thread_time()
        self._wait = self._sched.wait_s()

    def observe(self, lag_ms: float) -> None:
        """Account for the interval that ended with a sample ``lag_ms`` late."""
        cpu, wait = time.thread_time(), self._sched.wait_s()
        d_cpu, d_wait = cpu - self._cpu, wait - self._wait
        self._cpu, self._wait = cpu, wait
        wait_ms = 0.0 if d_wait != d_wait else d_wait * 1000.0  # nan: not reported
        self.adjusted.add(0.0, max(0.0, lag_ms - wait_ms))
        if lag_ms > ATTRIBUTION_THRESHOLD_MS:
            self.stall_ms += lag_ms
            self.cpu_ms += d_cpu * 1000.0
            self.runqueue_ms += d_wait * 1000.0

    def close(self) -> None:
        self._sched.close()

    def wire(self, stacks: dict[str, int]) -> dict[str, Any]:
        """Plain-data form for the trip back to the client."""
        return {
            "stall_ms": self.stall_ms,
            "loop_cpu_ms": self.cpu_ms,
            "runqueue_ms": self.runqueue_ms,
            "adjusted": {
                "max_ms": self.adjusted.max_ms,
                "stalls": list(self.adjusted.stalls),
                "hist": dict(self.adjusted.hist),
            },
            "stacks": sorted(((n, s) for s, n in stacks.items()), reverse=True),
        }


class StallWatchdog:
    """**Thread-safe (guarded by `_lock`).** Catches the loop thread's stack during stalls.

    A daemon thread checks every ``threshold / 4`` whether the probe's last beat is older than
    ``threshold``; if so it records the loop thread's current stack once per stall. It can
    only run when it gets the GIL, so code that holds the GIL in C for the whole stall is
    seen just after it (the stack then shows where the loop resumed).

    Parameters
    ----------
    loop_thread
        ``threading.get_ident()`` of the loop thread.
    threshold_s
        Staleness of the beat that counts as a stall.
    """

    def __init__(self, loop_thread: int, threshold_s: float) -> None:
        self._lock = threading.Lock()
        self._loop_thread = loop_thread
        self._threshold = threshold_s
        self._beat = time.monotonic()
        self._caught_beat = -1.0
        self._stacks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run_blocking, name="rechunk-p2p-stall-watchdog", daemon=True
        )
        self._thread.start()

    def beat(self) -> None:
        """Called on the loop at every sample."""
        self._beat = time.monotonic()  # a float store: atomic under the GIL

    def _run_blocking(self) -> None:
        while not self._stop.wait(self._threshold / 4):
            beat = self._beat
            if time.monotonic() - beat > self._threshold and beat != self._caught_beat:
                self._caught_beat = beat
                frames = sys._current_frames()
                frame = frames.pop(self._loop_thread, None)
                frames.pop(threading.get_ident(), None)
                if frame is not None:
                    self._record(_format_stack(frame) + _busy_threads(frames))

    def _record(self, stack: str) -> None:
        with self._lock:
            if stack in self._stacks or len(self._stacks) < MAX_STACKS:
                self._stacks[stack] = self._stacks.get(stack, 0) + 1

    def stop(self) -> dict[str, int]:
        """Stop the thread and return ``{stack: times caught}``."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            return dict(self._stacks)


#: Innermost functions of a thread that is idle (waiting), not holding the GIL.
_IDLE = frozenset(
    {
        "wait",
        "select",
        "poll",
        "get",
        "acquire",
        "_wait_for_tstate_lock",
        "sleep",
        "accept",
        "recv_into",
        "read",
        "readinto",
        "epoll",
        "_worker",
        "wait_for",
        "_recv",
        "_run_blocking",
    }
)


def _busy_threads(frames: dict[int, Any]) -> str:
    """Innermost frames of the other threads that are not visibly idle (GIL suspects)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in frames.items():
        if frame.f_code.co_name in _IDLE:
            continue
        out.append(f"-- thread {names.get(ident, ident)} (running or just ran):\n")
        out.append(_format_stack(frame, limit=4))
    return "".join(out)


def _format_stack(frame: Any, limit: int = 12) -> str:
    summary = traceback.extract_stack(frame, limit=limit)
    return "".join(
        f"{os.path.basename(f.filename)}:{f.lineno} {f.name}: {(f.line or '').strip()}\n"
        for f in summary
    )
