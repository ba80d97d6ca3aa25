"""Shared use of a run's store by the threads that write and take pieces, and sole use by
the one that moves its pieces from memory to disk.

Where it runs: task threads and the offload pool (blocking; never on an event loop: a
thread may wait here while another moves a store's pieces to disk).

A run's store is written by task threads (the pieces an input keeps here) and the offload
pool (pieces received), and read by the tasks that assemble outputs, all at once. When the
worker is short of memory, the pieces the store holds in memory go to disk
(:meth:`~rechunk_p2p.worker.run.WorkerRun.spill_blocking`): the store then decides anew,
for every output, where its pieces go, which no write or read may straddle. Each use of the
store is one pass through :meth:`StoreGate.shared`, and the move is one pass through
:meth:`StoreGate.sole`, which lets the uses begun finish and holds new ones back until it
is done.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class StoreGate:
    """**Thread-safe (guarded by `_changed`).** Many users at once, or one sole user; a
    sole user waiting holds new users back (a busy run does not starve it). Not
    re-entrant: a thread passes once at a time."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._users = 0
        self._sole = False

    def __repr__(self) -> str:
        return f"<StoreGate users={self._users} sole={self._sole}>"

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """One use of the store among others (waits while a sole user has it)."""
        with self._changed:
            while self._sole:
                self._changed.wait()
            self._users += 1
        try:
            yield
        finally:
            with self._changed:
                self._users -= 1
                if not self._users:
                    self._changed.notify_all()

    @contextlib.contextmanager
    def sole(self) -> Iterator[None]:
        """The store to oneself: waits for the uses begun, and keeps new ones waiting."""
        with self._changed:
            while self._sole:
                self._changed.wait()
            self._sole = True
            while self._users:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._sole = False
                self._changed.notify_all()
