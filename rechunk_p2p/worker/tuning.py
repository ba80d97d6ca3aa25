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
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rechunk_p2p.store.allocator import MallocTuning
from rechunk_p2p.store.pages import OUTPUT_PAGES

if TYPE_CHECKING:
    from rechunk_p2p.offload import OffloadPool

logger = logging.getLogger(__name__)

#: The interpreter's GIL switch interval while a run is open (Python's default is 5 ms):
#: the worker's event loop waits less for the GIL behind task, data-plane and offload
#: threads
GIL_SWITCH_INTERVAL = 0.001

#: Most objects frozen while runs are open; past it, full collections walk the rest as usual
#: (garbage cycles among frozen objects wait for the unfreeze: this bounds them)
_MAX_FROZEN_OBJECTS = 2_000_000


@dataclass(frozen=True)
class TuningOptions:
    """**Immutable.** What one holder asks of the process tuning (see :class:`ProcessTuning`).

    Parameters
    ----------
    switch_interval
        The GIL switch interval while held, in seconds (the shorter of it and the
        interpreter's); ``None`` leaves it.
    freeze
        Objects frozen out of full collections, and the survivors of each one while held.
    malloc
        glibc's malloc thresholds held (arrays up to 32 MiB from memory freed before).
    output_pages
        The pages of freed output chunks kept for the next outputs.
    """

    switch_interval: float | None = None
    freeze: bool = False
    malloc: bool = False
    output_pages: bool = False

    @classmethod
    def for_run(cls, enabled: bool, pieces_in_memory: bool = False) -> TuningOptions:
        """A run's (``process-tuning``: ``enabled``): everything, and malloc's
        thresholds where it keeps pieces in memory (not on disk, chosen to hold least: a heap
        keeps what it held at its fullest)."""
        if not enabled:
            return cls()
        return cls(GIL_SWITCH_INTERVAL, True, pieces_in_memory, True)

    @classmethod
    def for_request(cls, enabled: bool) -> TuningOptions:
        """A worker's request for a run, until the run holds its own: the interval and the
        freeze (a run's first tasks ask while the scheduler is busy with the graph, and a
        full collection of an unfrozen heap in that wait stopped the worker's loop)."""
        return cls(GIL_SWITCH_INTERVAL, True) if enabled else cls()


#: The freeze alone: a scheduler's, while a rechunk is on it
FREEZE_ONLY = TuningOptions(freeze=True)


class TuningHold:
    """**Thread-safe (guarded by its tuning's lock).** One holder's claim on the process
    tuning (:meth:`ProcessTuning.acquire`), given back once by :meth:`release`."""

    def __init__(self, tuning: ProcessTuning, options: TuningOptions) -> None:
        self.tuning = tuning
        self.options = options
        self.released = False

    def release(self) -> bool:
        """Give the settings back (where no other holder holds them); returns whether
        blocking tidy-up is owed (:meth:`ProcessTuning.tidy_blocking`, for a thread).
        Idempotent."""
        return self.tuning._release(self)

    async def release_and_tidy(self, offload: OffloadPool | None) -> None:
        """:meth:`release`, then the tidy-up owed in ``offload`` (left to the next run's
        release when there is no pool, or it was shut down: the worker is closing)."""
        if self.release() and offload is not None:
            try:
                await offload.to_thread(self.tuning.tidy_blocking)
            except RuntimeError:
                logger.debug("Process tuning released after the offload pool stopped")


class ProcessTuning:
    """**Thread-safe (guarded by `_lock`)**, but for ``survivors_frozen``, which only the
    garbage collector's callback changes (it cannot take the lock: a collection may start
    in a thread that holds it; collections never overlap, and the callback holds the GIL)
    and :meth:`unfreeze_unused` resets. Interpreter settings that keep the event loop
    responsive, applied while anything holds them (:meth:`acquire`: an open run, a request
    for one, a scheduler with a rechunk), each while at least one holder asked for it, and
    undone when the last such holder releases, so that other work on the cluster sees the
    interpreter as its user set it.

    - The GIL switch interval: a thread waiting for the GIL (the event loop, after its timer
      fired) waits up to one interval per hand-over while task, data-plane and offload
      threads run Python code; a shorter interval bounds how long the loop waits.
    - ``gc.freeze``: every full garbage collection walks every tracked object of the process
      and stops all its threads, the loop included. Freezing the objects that exist when
      the first holder asks (modules, distributed's own state, the user's data) leaves them
      out of later collections, and freezing the survivors of each full collection while
      held keeps the next one to what was made since: distributed's per-task state grows
      with every task the worker holds, and with tens of thousands of tasks a full
      collection of it stalls the loop visibly. The objects are also frozen when a transfer
      task reaches the worker (:meth:`freeze_early`): a worker takes a graph's task messages
      in one step of its loop, and their allocations can set off a full collection before
      its first run opens. Garbage cycles among frozen objects wait for ``gc.unfreeze``,
      which hands everything back to the oldest generation, and the full collection that
      follows (:meth:`unfreeze_unused`); both wait until nothing has held the tuning for a
      while, when the worker is idle (right after a run, the collection would stop the next
      one's first steps). At most ``_MAX_FROZEN_OBJECTS`` survivors are frozen, counted as
      they are: ``gc.get_freeze_count`` walks every frozen object, holding the GIL.
    - glibc's malloc thresholds (:class:`~rechunk_p2p.store.allocator.MallocTuning`):
      arrays up to 32 MiB come from memory freed before instead of fresh pages; the free
      memory is given back (:meth:`tidy_blocking`) when the last holder releases them.
    - The pages of freed output chunks, kept for the next outputs
      (:data:`~rechunk_p2p.store.pages.OUTPUT_PAGES`), unmapped by :meth:`tidy_blocking`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds = 0  # holders, whatever they asked for
        self._asked: Counter[str] = Counter()  # holders per option
        self._switch: float | None = None  # the interval to restore
        self._frozen = False  # objects frozen (by a holder, or early), not yet unfrozen
        self._collecting = False  # survivors of full collections are frozen too
        #: survivors frozen since the first holder froze (``_freeze_survivors`` adds to it)
        self.survivors_frozen = 0
        self.malloc = MallocTuning()
        self._owed: list[Callable[[], None]] = []  # blocking tidy-up for tidy_blocking

    def acquire(self, options: TuningOptions) -> TuningHold:
        """Apply what ``options`` asks for (each setting once, whoever asks first) until the
        hold returned is released."""
        with self._lock:
            self._holds += 1
            if options.switch_interval is not None and not self._asked["switch"]:
                self._switch = sys.getswitchinterval()
                sys.setswitchinterval(min(options.switch_interval, self._switch))
            if options.freeze:
                self._freeze_collecting()
            if options.malloc:
                self.malloc.hold()
            if options.output_pages:
                OUTPUT_PAGES.open()
            self._asked.update(_asked(options))
        return TuningHold(self, options)

    def _release(self, hold: TuningHold) -> bool:
        """Undo what ``hold`` asked for, where no other holder asks for it (but the freeze
        itself, see :meth:`unfreeze_unused`)."""
        with self._lock:
            if hold.released:
                return False
            hold.released = True
            self._holds -= 1
            self._asked.subtract(_asked(hold.options))
            options, asked = hold.options, self._asked
            if options.switch_interval is not None and not asked["switch"] and self._switch:
                sys.setswitchinterval(self._switch)
                self._switch = None
            if options.freeze and not asked["freeze"] and self._collecting:
                gc.callbacks.remove(_freeze_survivors)
                self._collecting = False
            if options.output_pages and (unmap := OUTPUT_PAGES.close()) is not None:
                self._owed.append(unmap)
            if options.malloc and not asked["malloc"] and self.malloc.release():
                self._owed.append(self.malloc.trim_blocking)
            return bool(self._owed)

    @property
    def holds(self) -> int:
        """Holds not released yet."""
        with self._lock:
            return self._holds

    def tidy_blocking(self) -> None:
        """The blocking work owed by releases: unmap the freed outputs' pages kept, give
        back the memory malloc kept. In a thread."""
        with self._lock:
            owed, self._owed = self._owed, []
        for work in owed:
            work()

    def _freeze_collecting(self) -> None:
        """Freeze now, and the survivors of full collections from now on (holding the lock).
        O(1): moves the tracked objects aside, traverses nothing."""
        gc.freeze()
        if not self._collecting:
            gc.callbacks.append(_freeze_survivors)
        self._frozen = self._collecting = True

    def freeze_early(self) -> None:
        """A transfer task reached the worker: freeze the objects that exist, unless a run
        holds the settings already. O(1); undone by :meth:`unfreeze_unused`."""
        with self._lock:
            if not self._holds:
                gc.freeze()
                self._frozen = True

    @property
    def frozen_unused(self) -> bool:
        """Objects are frozen and nothing holds the tuning."""
        with self._lock:
            return self._frozen and not self._holds

    def freeze_for_exit(self) -> None:
        """The process is about to exit: freeze every object. Python's exit collects the
        whole heap once (0.25-0.4 s for a worker that imported dask, pandas, xarray and
        zarr, paid in every worker's close); frozen objects are left out of it (0.04 s)."""
        with self._lock:
            gc.freeze()
            self._frozen = True

    def unfreeze_unused(self, collect: bool = True) -> bool:
        """When nothing holds the tuning: unfreeze, and if
        ``collect``, collect what the runs left (a full collection, which stops every thread
        of the process; else the interpreter's next one does). Returns whether it unfroze."""
        with self._lock:
            if self._holds or not self._frozen:
                return False
            gc.unfreeze()
            self._frozen = False
            self.survivors_frozen = 0
        if collect:
            gc.collect()
        return True


def _asked(options: TuningOptions) -> list[str]:
    """The options ``options`` asks for, as counted per option."""
    asked = {
        "switch": options.switch_interval is not None,
        "freeze": options.freeze,
        "malloc": options.malloc,
        "pages": options.output_pages,
    }
    return [name for name, on in asked.items() if on]


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
