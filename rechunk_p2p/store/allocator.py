"""glibc's allocator while runs are open: freed buffers serve again instead of fresh pages.

Where it runs: worker processes. :meth:`MallocTuning.hold` and :meth:`MallocTuning.release`
are two ``mallopt`` calls each (on the event loop, when a run opens or closes);
:meth:`MallocTuning.trim_blocking` walks the heaps and runs in the offload pool.

Why: distributed starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, and setting any malloc
threshold stops glibc from adapting its mmap threshold, which then stays at 128 KiB: every
array of 128 KiB or more is a fresh ``mmap``, each of its pages is faulted in and zeroed by
the kernel on first write, and ``munmap``-ed when freed. A rechunk frees and allocates such
arrays all the time (input chunks made by the tasks before it, batches received, cut
buffers): on the 3-D workload, 470,000 page faults a worker and about a second of kernel time
per worker and run. While a run that keeps pieces in memory is open (the worker plugin
decides; runs with ``storage: disk`` leave malloc alone), arrays up to
:data:`MAX_MMAP_THRESHOLD` come from memory freed before, and up to :data:`HELD_TOP_BYTES`
free at the top of a heap are kept.
Output chunks, which outlive the run, are mappings of their own
(:func:`rechunk_p2p.store.base.empty_output`), so freeing them later gives their memory
back as before. When the last run closes, the thresholds in force before are set again and
the free memory is given back (``malloc_trim``). Arrays that other tasks make while a run is
open and keep past it come from the heap too: memory they free later is given back to the
system by the next run's ``malloc_trim`` (or by malloc itself at the top of a heap).

Elsewhere than Linux with glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Mapping

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: glibc's default for both thresholds, in force when the environment sets neither
GLIBC_DEFAULT_THRESHOLD = 128 * 1024
#: The largest mmap threshold glibc accepts on 64-bit systems
MAX_MMAP_THRESHOLD = 32 * 2**20
#: Free memory kept at the top of a heap while runs are open
HELD_TOP_BYTES = 64 * 2**20
#: ``mallopt`` takes a C ``int`` (ctypes would wrap a larger value around)
_INT_MAX = 2**31 - 1


def load_glibc() -> ctypes.CDLL | None:
    """The C library of this process if it is glibc with ``mallopt`` and ``malloc_trim``;
    ``None`` otherwise."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (AttributeError, OSError, ValueError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def threshold_from_environment(environ: Mapping[str, str], name: str) -> int:
    """The threshold ``name`` (``"trim_threshold"``, ``"mmap_threshold"``) glibc read from the
    environment when the process started: ``GLIBC_TUNABLES`` or ``MALLOC_<NAME>_``, else its
    default; within what ``mallopt`` takes (a C ``int``, not negative)."""
    value = environ.get(f"MALLOC_{name.upper()}_")
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        key, _, setting = item.partition("=")
        if key == f"glibc.malloc.{name}":
            value = setting
    try:
        threshold = int(value, 0) if value else GLIBC_DEFAULT_THRESHOLD
    except ValueError:
        return GLIBC_DEFAULT_THRESHOLD
    return min(max(threshold, 0), _INT_MAX)


class MallocTuning:
    """**Thread-safe (guarded by `_lock`).** The malloc thresholds of this process, held
    while runs are open.

    Parameters
    ----------
    libc
        The C library (default: :func:`load_glibc`); ``None`` changes nothing.
    environ
        Where the thresholds in force before come from (default: ``os.environ``). A
        process that never set one had glibc's adaptive mmap threshold, which ``mallopt``
        ends: it gets the fixed default back.
    """

    def __init__(
        self, libc: ctypes.CDLL | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self._libc = load_glibc() if libc is None else libc
        env = os.environ if environ is None else environ
        self.before_trim = threshold_from_environment(env, "trim_threshold")
        self.before_mmap = threshold_from_environment(env, "mmap_threshold")
        self._lock = threading.Lock()
        self._held = False

    @property
    def available(self) -> bool:
        """Whether this process's allocator can be tuned."""
        return self._libc is not None

    @property
    def held(self) -> bool:
        """Whether the thresholds are held (runs are open)."""
        with self._lock:
            return self._held

    def hold(self) -> None:
        """A run opens: arrays up to :data:`MAX_MMAP_THRESHOLD` come from freed memory, and
        up to :data:`HELD_TOP_BYTES` free at the top of a heap are kept, until
        :meth:`release` (the one in force before, when higher, stays)."""
        if self._libc is None:
            return
        with self._lock:
            if self._held:
                return
            self._libc.mallopt(_M_TRIM_THRESHOLD, max(self.before_trim, HELD_TOP_BYTES))
            self._libc.mallopt(_M_MMAP_THRESHOLD, max(self.before_mmap, MAX_MMAP_THRESHOLD))
            self._held = True

    def release(self) -> bool:
        """The last run closed: set the thresholds in force before. Returns whether they had
        been held (then :meth:`trim_blocking` gives the free memory back)."""
        if self._libc is None:
            return False
        with self._lock:
            if not self._held:
                return False
            self._libc.mallopt(_M_MMAP_THRESHOLD, self.before_mmap)
            self._libc.mallopt(_M_TRIM_THRESHOLD, self.before_trim)
            self._held = False
            return True

    def trim_blocking(self) -> None:
        """Give the free memory of every heap back to the system (``malloc_trim(0)``; ctypes
        releases the GIL for the call)."""
        if self._libc is not None:
            self._libc.malloc_trim(0)
