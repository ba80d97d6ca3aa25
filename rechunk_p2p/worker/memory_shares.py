"""One memory budget per worker, shared by every run open there, and where outputs that a
continuation gives a worker wait: in memory while the budget has room, else on disk.

Where it runs: the worker's event loop (runs open, continue and close there); the stores it
makes and hands back are used from task threads and the offload pool.

``storage: auto`` keeps a worker's pieces in memory within ``storage-memory-fraction`` of its
memory limit. The budget is the worker's, not each run's: an xarray Dataset's variables are
rechunked by runs that are open at once, and a budget per run let three runs on a 3 GiB
worker hold 2.26 GiB between them, past distributed's pause threshold (80 %), after which
the worker ran none of the tasks that would have freed it. A run keeps in memory what the
budget has room for when it opens (its *reservation*), the rest of its outputs spill; a
continuation that moves outputs here (an owner left, the run went on with fewer workers)
asks the budget again for them, and those that do not fit spill although the run started
in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rechunk_p2p.spec import RunSpec
from rechunk_p2p.store import MemoryPieceStore, PieceStore
from rechunk_p2p.store.assembling import AssemblingMemoryStore
from rechunk_p2p.store.disk import DiskPieceStore
from rechunk_p2p.store.split import SplitStore


class MemoryShares:
    """**Loop-confined** (the worker's loop). The bytes of pieces that the open runs of one
    worker keep in memory, within the worker's budget (``storage-memory-fraction`` of its
    memory limit, read as each run opens)."""

    def __init__(self) -> None:
        self._reserved: dict[RunMemory, int] = {}
        # distributed paused the worker (short of memory): no run keeps more in memory
        self.pressed = False

    def __repr__(self) -> str:
        return f"<MemoryShares reserved={self.reserved} runs={len(self)}>"

    def __len__(self) -> int:
        return len(self._reserved)

    @property
    def reserved(self) -> int:
        """Bytes reserved by every open run."""
        return sum(self._reserved.values())

    def available(self, budget: float | None) -> float | None:
        """Bytes a budget of ``budget`` still has room for (``None``: no bound; none while
        the worker is paused, :attr:`pressed`)."""
        if self.pressed:
            return 0.0
        if budget is None:
            return None
        return max(budget - self.reserved, 0.0)

    def reserve(self, run: RunMemory, nbytes: int) -> None:
        """``run`` keeps ``nbytes`` more in memory."""
        self._reserved[run] = self._reserved.get(run, 0) + int(nbytes)

    def release(self, run: RunMemory) -> None:
        """``run`` closed: what it reserved is free again (idempotent)."""
        self._reserved.pop(run, None)


class RunMemory:
    """**Loop-confined** (the worker's loop), but for :meth:`spillable`. One run's share
    of its worker's :class:`MemoryShares`: reserved when the run opens, asked again for the
    outputs a continuation moves here, given back when the run closes (or spills).

    Parameters
    ----------
    shares
        What the worker's runs keep in memory.
    budget
        The worker's budget (``None``: no memory limit).
    spill
        Makes the disk store that outputs past the budget go to (called at most once, when
        a continuation first spills or the worker is paused).
    """

    def __init__(
        self,
        shares: MemoryShares,
        budget: float | None,
        spill: Callable[[], DiskPieceStore],
    ) -> None:
        self._shares = shares
        self._budget = budget
        self._spill = spill

    def reserve(self, nbytes: int) -> None:
        """The run keeps ``nbytes`` in memory (the outputs it fills there)."""
        self._shares.reserve(self, nbytes)

    def release(self) -> None:
        """The run closed."""
        self._shares.release(self)

    def take_moved(
        self, store: PieceStore, run_spec: RunSpec, outputs: Sequence[int]
    ) -> PieceStore:
        """The store in which ``outputs``, moved to this worker by the continuation
        ``run_spec``, wait for their pieces: ``store`` itself where they fit what the budget
        has left (or ``store`` keeps nothing in memory), else ``store`` split so that the
        outputs past the budget spill. Their pieces have not come yet (they are sent anew
        after the continuation), so nothing stored moves."""
        if not outputs or isinstance(store, DiskPieceStore):
            return store
        flats = np.asarray(sorted(outputs), dtype=np.int64)
        fits = fitting(run_spec, flats, self._shares.available(self._budget))
        kept = flats[fits]
        self.reserve(int(output_bytes(run_spec, kept).sum()))
        if fits.all() or isinstance(store, MemoryPieceStore):
            # (a store of outputs of unknown sizes, or of objects, cannot split: it holds them)
            return store
        store = self.spillable(store, run_spec)
        assert isinstance(store, SplitStore)
        store.place(flats[~fits], in_memory=False)
        store.place(kept, in_memory=True)
        return store

    def spillable(self, store: PieceStore, run_spec: RunSpec) -> PieceStore:
        """``store`` as a store whose outputs can go to disk, output by output: an
        assembling memory store becomes a split store with every output in memory, any
        other store stays as it is. Touches no reservation (callable from any thread, under
        the run's lock)."""
        if not isinstance(store, AssemblingMemoryStore):
            return store
        in_memory = np.ones(run_spec.spec.partial.n_outputs, dtype=bool)
        return SplitStore(store, self._spill(), in_memory)


def output_bytes(run_spec: RunSpec, flats: np.ndarray) -> np.ndarray:
    """Bytes of each output ``flats`` of the run."""
    spec = run_spec.spec
    return spec.partial.output_sizes(flats) * spec.dtype.itemsize


def fitting(run_spec: RunSpec, flats: np.ndarray, room: float | None) -> np.ndarray:
    """One boolean per output of ``flats`` (in the order given): the first ones whose bytes
    add up to at most ``room`` (every one where ``room`` is ``None``)."""
    if room is None:
        return np.ones(len(flats), dtype=bool)
    return np.cumsum(output_bytes(run_spec, flats)) <= room
