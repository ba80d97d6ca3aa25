"""Which outputs a worker's run assembled, is assembling, and keeps for a continuation.

Where it runs: task threads (an output's assembly), the worker's event loop (a continuation
keeps outputs, or takes back one assembled here); small sets and references only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


class RunOutputs:
    """**Thread-safe (guarded by `_lock`).** The outputs one run assembled on this worker
    (their pieces are consumed), the ones being assembled, the last ``recent`` results, and
    the results kept for a continued run's task of the same output.

    The scheduler continues a run by releasing the tasks of the outputs it keeps, and the
    worker drops their results; :meth:`keep` holds them for the continued run's tasks, from
    the results the worker holds, the outputs assembled last, or an assembly still running
    (kept when it finishes).
    """

    def __init__(self, recent: int) -> None:
        self._lock = threading.Lock()
        self._assembled: set[int] = set()
        self._assembling: set[int] = set()
        self._kept: dict[int, np.ndarray] = {}
        self._keep_when_done: set[int] = set()
        self._recent: OrderedDict[int, np.ndarray] = OrderedDict()
        self._recent_size = recent

    def begin(self, flat: int) -> tuple[np.ndarray | None, bool]:
        """Output ``flat``'s task starts: its result if it was kept, else whether it was
        assembled here before (its pieces are consumed); otherwise it is assembling now."""
        with self._lock:
            kept = self._kept.pop(flat, None)
            consumed = kept is None and flat in self._assembled
            if kept is None and not consumed:
                self._assembling.add(flat)
        return kept, consumed

    def failed(self, flat: int) -> None:
        """The assembly of ``flat`` failed: its pieces are not consumed."""
        with self._lock:
            self._assembling.discard(flat)

    def done(self, flat: int, out: np.ndarray) -> None:
        """``flat`` was assembled as ``out``: kept if a continuation asked for it while it
        assembled, else one of the recent results (one step: :meth:`keep` sees the output
        assembling or assembled)."""
        with self._lock:
            self._assembling.discard(flat)
            self._assembled.add(flat)
            if flat in self._keep_when_done:
                self._keep_when_done.discard(flat)
                self._kept[flat] = out
            else:
                self._recent[flat] = out
                while len(self._recent) > self._recent_size:
                    self._recent.popitem(last=False)

    def keep(self, outputs: list[int], held: dict[int, np.ndarray]) -> int:
        """Keep the results of ``outputs`` for the continued run's tasks: from ``held`` (the
        results the worker holds), the recent results, or an assembly running now (kept when
        it finishes). Returns how many were kept now."""
        kept = 0
        with self._lock:
            for flat in outputs:
                value = held.get(flat)
                if value is None:
                    value = self._recent.pop(flat, None)
                if value is not None:
                    self._kept[flat] = value
                    kept += 1
                elif flat in self._assembling:
                    self._keep_when_done.add(flat)
        return kept

    def take_back(self, outputs: list[int], forget: Callable[[list[int]], None]) -> None:
        """``outputs`` come back to this worker to be assembled again (their results were
        lost): the ones assembled here are ``forget``-ten by the store (their pieces are
        sent anew and stored as new ones) and no longer counted as assembled, in one step
        that no task of theirs starts in between."""
        with self._lock:
            back = [flat for flat in outputs if flat in self._assembled]
            if back:
                forget(back)
                self._assembled.difference_update(back)

    def clear(self) -> None:
        """The run closed: drop the results held."""
        with self._lock:
            self._kept.clear()
            self._recent.clear()
