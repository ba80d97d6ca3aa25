"""Interpreter settings a worker process runs rechunks under, applied while runs are open
(and the freeze of objects alone, which the scheduler's process holds while a rechunk is on
the scheduler: :mod:`rechunk_p2p.scheduler_tuning`).

Where it runs: any thread of a worker or scheduler process (the settings are process-wide;
the state is guarded by a lock): the worker plugin's loop when a run opens or closes, task
threads when a transfer arrives, the scheduler's loop, and whichever thread runs a full
garbage collection.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable
from typing import Any

from dask.utils import parse_timedelta

from rechunk_p2p.store.allocator import MallocTuning
from rechunk_p2p.store.pages import OUTPUT_PAGES

#: The interpreter's GIL switch interval while a run is open (Python's default is 5 ms):
#: the worker's event loop waits less for the GIL behind task, data-plane and offload
#: threads
GIL_SWITCH_INTERVAL = 0.001

#: Most objects frozen while runs are open; past it, full collections walk the rest as usual
#: (garbage cycles among frozen objects wait for the unfreeze: this bounds them)
_MAX_FROZEN_OBJECTS = 2_000_000


class ProcessTuning:
    """**Thread-safe (guarded by `_lock`)**, but for ``survivors_frozen``, which only the
    garbage collector's callback changes (it cannot take the lock: a collection may start
    in a thread that holds it; collections never overlap, and the callback holds the GIL)
    and :meth:`unfreeze_unused` resets. Interpreter settings that keep the event loop
    responsive, applied while any run is open in this process, or being asked for, and
    undone when the last one closes, so that other work on the cluster sees the interpreter
    as its user set it.

    - The GIL switch interval: a thread waiting for the GIL (the event loop, after its timer
      fired) waits up to one interval per hand-over while task, data-plane and offload
      threads run Python code; a shorter interval bounds how long the loop waits.
    - ``gc.freeze``: every full garbage collection walks every tracked object of the process
      and stops all its threads, the loop included. Freezing the objects that exist when the
      first run opens (modules, distributed's own state, the user's data) leaves them out of
      later collections, and freezing the survivors of each full collection while runs are
      open keeps the next one to what was made since: distributed's per-task state grows
      with every task the worker holds, and with tens of thousands of tasks a full
      collection of it stalls the loop visibly. The objects are also frozen when a transfer task
      reaches the worker (:meth:`freeze_early`): a worker takes a graph's task messages in
      one step of its loop, and their allocations can set off a full collection before its
      first run opens. Garbage cycles among frozen objects wait for ``gc.unfreeze``, which
      hands everything back to the oldest generation, and the full collection that follows
      (:meth:`unfreeze_unused`); both wait until no run has been open for a while, when
      the worker is idle (right after a run, the collection would stop the next one's
      first steps). At most ``_MAX_FROZEN_OBJECTS`` survivors are frozen, counted as they
      are: ``gc.get_freeze_count`` walks every frozen object, holding the GIL.
    - glibc's malloc thresholds (:class:`~rechunk_p2p.store.allocator.MallocTuning`), when
      the first run keeps pieces in memory (``memory``, ``memory+disk``): arrays up to
      32 MiB come from memory freed before instead of fresh pages; the free memory is given
      back when the last run closes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._freezers = 0  # holders of the freeze alone (a scheduler, see hold_freeze)
        self._switch: float | None = None
        self._frozen = False  # objects frozen (by a run, or early), not yet unfrozen
        self._collecting = False  # survivors of full collections are frozen too
        #: survivors frozen since the first run opened (``_freeze_survivors`` adds to it)
        self.survivors_frozen = 0
        self.malloc = MallocTuning()
        self._output_pages = False  # OUTPUT_PAGES opened by a run

    def acquire(
        self, interval: Any, freeze: bool, malloc: bool = False, output_pages: bool = False
    ) -> None:
        """A run opens: apply the settings (the GIL switch ``interval``, ``None`` to leave
        it; whether to ``freeze`` survivors of collections; whether to hold ``malloc``'s
        thresholds; whether to keep freed outputs' pages for the next outputs)."""
        with self._lock:
            self._users += 1
            if malloc:  # also when another run, or a run's request, holds the rest
                self.malloc.hold()
            if output_pages and not self._output_pages:
                OUTPUT_PAGES.open()
                self._output_pages = True
            if self._users > 1:
                return
            if interval is not None:
                self._switch = sys.getswitchinterval()
                sys.setswitchinterval(min(parse_timedelta(interval), self._switch))
            if freeze:
                self._freeze_collecting()

    def _freeze_collecting(self) -> None:
        """Freeze now, and the survivors of full collections from now on (holding the lock).
        O(1): moves the tracked objects aside, traverses nothing."""
        gc.freeze()
        if not self._collecting:
            gc.callbacks.append(_freeze_survivors)
        self._frozen = self._collecting = True

    def hold_freeze(self) -> None:
        """Freeze the objects (and survivors of full collections) until
        :meth:`release_freeze`, leaving the other settings alone: the scheduler's process,
        while a rechunk is on the scheduler (it may host workers too: the freeze lasts until
        neither holds it)."""
        with self._lock:
            self._freezers += 1
            self._freeze_collecting()

    def release_freeze(self) -> None:
        """Undo one :meth:`hold_freeze` but the freeze itself (see :meth:`unfreeze_unused`)."""
        with self._lock:
            self._freezers -= 1
            if not self._freezers and not self._users and self._collecting:
                gc.callbacks.remove(_freeze_survivors)
                self._collecting = False

    def release(self) -> Callable[[], None] | None:
        """A run closed; when it was the last, undo the settings but the freeze (see
        :meth:`unfreeze_unused`). Returns blocking work to run in a thread: unmapping the
        freed outputs' pages kept, and giving back the memory malloc kept."""
        with self._lock:
            self._users -= 1
            if self._users:
                return None
            if self._switch is not None:
                sys.setswitchinterval(self._switch)
                self._switch = None
            if self._collecting and not self._freezers:
                gc.callbacks.remove(_freeze_survivors)
                self._collecting = False
            unmap = None
            if self._output_pages:
                unmap = OUTPUT_PAGES.close()
                self._output_pages = False
            trim = self.malloc.trim_blocking if self.malloc.release() else None
        if unmap is None or trim is None:
            return unmap or trim

        def unmap_and_trim_blocking() -> None:
            unmap()
            trim()

        return unmap_and_trim_blocking

    def freeze_early(self) -> None:
        """A transfer task reached the worker: freeze the objects that exist, unless a run
        holds the settings already. O(1); undone by :meth:`unfreeze_unused`."""
        with self._lock:
            if not self._users and not self._freezers:
                gc.freeze()
                self._frozen = True

    @property
    def frozen_unused(self) -> bool:
        """Objects are frozen and no run (or request for one) holds the settings, nor any
        holder the freeze."""
        with self._lock:
            return self._frozen and not self._users and not self._freezers

    def freeze_for_exit(self) -> None:
        """The process is about to exit: freeze every object. Python's exit collects the
        whole heap once (0.25-0.4 s for a worker that imported dask, pandas, xarray and
        zarr, paid in every worker's close); frozen objects are left out of it (0.04 s)."""
        with self._lock:
            gc.freeze()
            self._frozen = True

    def unfreeze_unused(self, collect: bool = True) -> bool:
        """When no run holds the settings, nor a holder the freeze: unfreeze, and if
        ``collect``, collect what the runs left (a full collection, which stops every thread
        of the process; else the interpreter's next one does). Returns whether it unfroze."""
        with self._lock:
            if self._users or self._freezers or not self._frozen:
                return False
            gc.unfreeze()
            self._frozen = False
            self.survivors_frozen = 0
        if collect:
            gc.collect()
        return True


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """A ``gc.callbacks`` entry while runs are open: after a full collection, freeze its
    survivors. Runs in whichever thread collected, holding the GIL; takes time in the
    number of survivors (the oldest generation holds only them), which the collection
    itself just walked."""
    if phase != "stop" or info["generation"] != 2:
        return
    survivors = len(gc.get_objects(generation=2))
    if PROCESS_TUNING.survivors_frozen + survivors <= _MAX_FROZEN_OBJECTS:
        PROCESS_TUNING.survivors_frozen += survivors
        gc.freeze()


#: The one per process (the interpreter settings are process-wide)
PROCESS_TUNING = ProcessTuning()
