"""Making a run on a worker: its store (where its storage choice puts it), its send
buffer, and the process tuning held while it is open.

Where it runs: the worker loop (when a run is fetched from the scheduler); no blocking.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.settings import WorkerSettings
from rechunk_p2p.spec import RunSpec
from rechunk_p2p.store import DiskPieceStore, make_store
from rechunk_p2p.store.files import ENGINE_DIRECTORY
from rechunk_p2p.transport import comm as comm_module
from rechunk_p2p.transport.comm import CommBuffer
from rechunk_p2p.transport.dataplane import DataPlane
from rechunk_p2p.transport.limiter import ByteLimiter
from rechunk_p2p.transport.wire import Packed
from rechunk_p2p.worker.memory_shares import MemoryShares, RunMemory
from rechunk_p2p.worker.run import WorkerRun
from rechunk_p2p.worker.storage_choice import StorageChoice, direct_io, resolve_storage
from rechunk_p2p.worker.tuning import PROCESS_TUNING as _tuning
from rechunk_p2p.worker.tuning import TuningOptions


def make_run(
    run_spec: RunSpec,
    worker: Any,
    dataplane: DataPlane,
    offload: OffloadPool,
    closing: Callable[[], bool],
    shares: MemoryShares,
    store_io: OffloadPool | None = None,
) -> WorkerRun:
    """A new run of ``run_spec`` on ``worker``: its store (within what the worker's memory
    budget ``shares`` has left, spilling through ``store_io``, the worker's store I/O pool),
    its send buffer on ``dataplane``, and the process tuning held while it is open (released
    when it closes)."""
    settings = WorkerSettings.read()
    address = worker.address
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    budget = settings.memory_budget(limit)
    disk_buffer = settings.disk_buffer_bytes(limit)
    choice = resolve_storage(run_spec, address, shares.available(budget))
    directory = os.path.join(worker.local_directory, ENGINE_DIRECTORY)
    spec, partial = run_spec.spec, run_spec.spec.partial
    known = not spec.unknown_axes  # outputs can be filled as their pieces come
    name = f"{run_spec.shuffle_id}-run{run_spec.run_id}"
    store = make_store(
        choice.kind,
        dtype=spec.dtype,
        directory=directory,
        name=name,
        buffer_bytes=disk_buffer,
        direct_io=direct_io(run_spec, choice, address, settings),
        partial=partial if known else None,
        in_memory=choice.in_memory,
        io_pool=store_io,
    )

    def spill() -> DiskPieceStore:  # outputs a continuation moves here, past the budget
        io = direct_io(run_spec, StorageChoice("disk"), address, settings)
        return DiskPieceStore(spec.dtype, directory, name, disk_buffer, io, store_io)

    memory = RunMemory(shares, budget, spill)
    memory.reserve(choice.reserved)

    shuffle_id, run_id = run_spec.shuffle_id, run_spec.run_id

    async def send(address: str, batch: list[Packed]) -> None:
        # the current id of ``run`` (made below): a receiver that has not heard of a
        # continuation yet fetches it first (and checks the moved outputs' owners with it)
        await dataplane.send(address, shuffle_id, run.run_id, batch)
        run.sent(batch)

    comm = CommBuffer(
        send,
        dataplane.limiter,
        dataplane.send_slots,  # type: ignore[arg-type]
        message_bytes=settings.message_bytes,
        retry=replace(comm_module.RETRY, timeout=settings.timeout),
        name=f"Rechunk {shuffle_id} (run {run_id}) on {worker.address}",
        run_limiter=(
            None
            if run_spec.spec.send_buffer_bytes is None
            else ByteLimiter(run_spec.spec.send_buffer_bytes)
        ),
        loop=dataplane.loop,
        closing=closing,
    )
    in_memory = choice.kind in ("memory", "memory+disk")
    tuning = _tuning.acquire(TuningOptions.for_run(settings.process_tuning, in_memory))
    run = WorkerRun(
        run_spec,
        worker.address,
        store,
        dataplane,
        offload,
        comm,
        tuning=tuning,
        recent_outputs=max(getattr(worker, "nthreads", 1), 1),
        memory=memory,
    )
    return run
