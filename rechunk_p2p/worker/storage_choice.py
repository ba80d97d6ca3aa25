"""Where a run keeps the pieces a worker receives: memory, disk, or the first outputs in
memory and the rest on disk; and whether spilled pieces bypass the page cache.

Where it runs: pure (the worker plugin's loop calls it when a run opens there, with the
worker's address and memory limit).
"""

from __future__ import annotations

import numpy as np
from distributed.comm import get_address_host

from rechunk_p2p.settings import WorkerSettings
from rechunk_p2p.spec import RunSpec
from rechunk_p2p.store.direct import writeback_threshold_bytes


def resolve_storage(
    run_spec: RunSpec, address: str, memory_limit: float | None, settings: WorkerSettings
) -> tuple[str, np.ndarray | None]:
    """The run's store kind on the worker at ``address`` and, for ``"memory+disk"``, which
    outputs stay in memory.

    ``auto``: memory when this worker's share of the run fits ``storage-memory-fraction``
    of its ``memory_limit`` (``None``: no limit, memory). When it does not, the first of
    this worker's outputs that fit that budget are filled in memory and the others spilled
    (``"memory+disk"``); disk when none fits, or outputs cannot be filled as they come
    (unknown chunk sizes, object dtype).
    """
    storage = run_spec.spec.storage
    if storage != "auto":
        return storage, None
    budget = settings.memory_budget(memory_limit)
    if budget is None:
        return "memory", None
    estimate = run_spec.spec.nbytes / max(len(run_spec.workers), 1)
    if estimate <= budget:
        return "memory", None
    in_memory = outputs_within(run_spec, address, budget)
    return ("disk", None) if in_memory is None else ("memory+disk", in_memory)


def direct_io(
    run_spec: RunSpec,
    storage: str,
    address: str,
    memory_limit: float | None,
    settings: WorkerSettings,
) -> bool | None:
    """``disk-direct-io`` for the run's store on the worker at ``address``. ``auto``: not
    when the pieces this host's workers are expected to spill (this worker's share of the
    run, beyond its memory budget, times the run's workers on this host) fit within the page
    cache's writeback threshold: the cache holds them then, and serves them back from
    memory; else the store decides by its first write (``None``)."""
    chosen = settings.direct_io
    if chosen is not None or storage not in ("disk", "memory+disk"):
        return chosen
    threshold = writeback_threshold_bytes()
    if threshold is None:
        return False
    share = run_spec.spec.nbytes / max(len(run_spec.workers), 1)
    if storage == "memory+disk":
        share -= settings.memory_budget(memory_limit) or 0
    host = _host(address)
    here = sum(_host(w) == host for w in run_spec.workers)
    return None if share * max(here, 1) > threshold else False


def outputs_within(run_spec: RunSpec, address: str, budget: float) -> np.ndarray | None:
    """One boolean per flat output: the first outputs (ascending) of the worker at
    ``address`` whose bytes add up to at most ``budget``; ``None`` when none fits or outputs
    cannot be filled as their pieces come."""
    spec = run_spec.spec
    if spec.unknown_axes or spec.dtype.hasobject:
        return None
    if address not in run_spec.workers:
        return None
    outputs = spec.outputs_array
    position = run_spec.workers.index(address)
    mine = outputs[run_spec.owner_positions(outputs) == position]
    nbytes = spec.partial.output_sizes(mine) * spec.dtype.itemsize
    fits = np.cumsum(nbytes) <= budget
    if not fits.any():
        return None
    in_memory = np.zeros(spec.partial.n_outputs, dtype=bool)
    in_memory[mine[fits]] = True
    return in_memory


def _host(address: str) -> str:
    """The host of a worker's address (the address itself where it names no host and port,
    as in-process test seams do)."""
    try:
        return get_address_host(address)
    except ValueError:
        return address
