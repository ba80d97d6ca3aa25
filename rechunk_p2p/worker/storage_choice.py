"""Where a run keeps the pieces a worker receives: memory, disk, or the first outputs in
memory and the rest on disk; and whether spilled pieces bypass the page cache.

Where it runs: pure (the worker plugin's loop calls it when a run opens there, with the
worker's address and the room its memory budget has left, :mod:`.memory_shares`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from distributed.comm import get_address_host

from rechunk_p2p.settings import WorkerSettings
from rechunk_p2p.spec import RunSpec
from rechunk_p2p.store.base import StoreKind
from rechunk_p2p.store.direct import writeback_threshold_bytes
from rechunk_p2p.worker.memory_shares import fitting, output_bytes


@dataclass(frozen=True)
class StorageChoice:
    """**Immutable.** Where a run keeps this worker's pieces.

    Attributes
    ----------
    kind
        The store's kind: ``"memory"``, ``"disk"`` or ``"memory+disk"``.
    in_memory
        For ``"memory+disk"``: one boolean per flat output, whether it is filled in memory.
    reserved
        Bytes of the worker's memory budget the run takes (its outputs filled in memory).
    """

    kind: StoreKind
    in_memory: np.ndarray | None = None
    reserved: int = 0


def resolve_storage(run_spec: RunSpec, address: str, room: float | None) -> StorageChoice:
    """The run's store on the worker at ``address``, whose memory budget has ``room`` bytes
    left for it (``None``: no memory limit).

    ``auto``: memory when this worker's outputs of the run fit ``room``. When they do not,
    the first of them that fit are filled in memory and the others spilled
    (``"memory+disk"``); disk when none fits, or outputs cannot be filled as they come
    (unknown chunk sizes, object dtype).
    """
    storage = run_spec.spec.storage
    if storage != "auto":
        return StorageChoice(storage)
    if room is None:
        return StorageChoice("memory")
    mine = own_outputs(run_spec, address)
    nbytes = output_bytes(run_spec, mine)
    if nbytes.sum() <= room:
        return StorageChoice("memory", reserved=int(nbytes.sum()))
    spec = run_spec.spec
    fits = fitting(run_spec, mine, room)
    if spec.unknown_axes or spec.dtype.hasobject or not fits.any():
        return StorageChoice("disk")
    in_memory = np.zeros(spec.partial.n_outputs, dtype=bool)
    in_memory[mine[fits]] = True
    return StorageChoice("memory+disk", in_memory, int(nbytes[fits].sum()))


def own_outputs(run_spec: RunSpec, address: str) -> np.ndarray:
    """The flat outputs the worker at ``address`` assembles, ascending (none where it is
    not a worker of the run)."""
    outputs = run_spec.spec.outputs_array
    if address not in run_spec.workers:
        return outputs[:0]
    position = run_spec.workers.index(address)
    return np.sort(outputs[run_spec.owner_positions(outputs) == position])


def direct_io(
    run_spec: RunSpec, choice: StorageChoice, address: str, settings: WorkerSettings
) -> bool | None:
    """``disk-direct-io`` for the run's store on the worker at ``address``. ``auto``: not
    when the pieces this host's workers are expected to spill (this worker's share of the
    run, beyond what it keeps in memory, times the run's workers on this host) fit within the page
    cache's writeback threshold: the cache holds them then, and serves them back from
    memory; else the store decides by its first write (``None``)."""
    chosen = settings.direct_io
    if chosen is not None or choice.kind not in ("disk", "memory+disk"):
        return chosen
    threshold = writeback_threshold_bytes()
    if threshold is None:
        return False
    share = run_spec.spec.nbytes / max(len(run_spec.workers), 1) - choice.reserved
    host = _host(address)
    here = sum(_host(w) == host for w in run_spec.workers)
    return None if share * max(here, 1) > threshold else False


def _host(address: str) -> str:
    """The host of a worker's address (the address itself where it names no host and port,
    as in-process test seams do)."""
    try:
        return get_address_host(address)
    except ValueError:
        return address
