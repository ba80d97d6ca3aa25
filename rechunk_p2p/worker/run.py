"""One worker's share of one run of a sub-shuffle: cut inputs, buffer shards, build outputs.

Where it runs: ``add_input_blocking`` and ``get_output_blocking`` in task threads;
``receive`` on the data plane's loop (it hands the write to the offload pool); ``flush`` and
``close`` on the worker's event loop (they hop to the data plane loop and the offload pool).
"""

from __future__ import annotations

import enum
import threading
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from rechunk_p2p.buffers.base import Shard, ShardStore
from rechunk_p2p.buffers.comm import CommBuffer, CommStatistics
from rechunk_p2p.buffers.wire import Packed, pack_blocking, unpack_blocking
from rechunk_p2p.errors import RechunkRunError, StaleRunError
from rechunk_p2p.offload import OffloadPool, from_thread, on_loop
from rechunk_p2p.spec import RunSpec, widen
from rechunk_p2p.worker.dataplane import DataPlane


class RunPhase(enum.Enum):
    """Where a run is on one worker. Changed only by :meth:`WorkerRun._set_phase`."""

    TRANSFERRING = "transferring"
    INPUTS_DONE = "inputs-done"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RunStatistics:
    """**Immutable.** What one run did on one worker."""

    id: str
    run_id: int
    phase: str
    storage: str
    inputs: int
    outputs: int
    bytes_local: int
    bytes_received: int
    bytes_sent: int
    bytes_spilled: int
    bytes_buffered: int


class WorkerRun:
    """**Thread-safe (guarded by `_lock`).** The state of one run on one worker.

    Parameters
    ----------
    run_spec
        The run.
    worker_address
        This worker.
    store
        Where shards for this worker's outputs wait until assembly.
    storage
        The store's kind, for diagnostics.
    dataplane
        The worker's data plane (send and receive happen on its loop).
    offload
        The pool that writes received shards into the store.
    comm
        The run's send buffer (confined to the data plane's loop).
    """

    def __init__(
        self,
        run_spec: RunSpec,
        worker_address: str,
        store: ShardStore,
        storage: str,
        dataplane: DataPlane,
        offload: OffloadPool,
        comm: CommBuffer,
    ) -> None:
        self.run_spec = run_spec
        self.worker_address = worker_address
        self.storage = storage
        self._store = store
        self._dataplane = dataplane
        self._offload = offload
        self._comm = comm
        self._lock = threading.Lock()
        self._phase = RunPhase.TRANSFERRING
        self._inputs = 0
        self._outputs = 0
        self._bytes_local = 0
        self._bytes_received = 0
        self._closed = threading.Event()

    def __repr__(self) -> str:
        phase = self.phase.value
        return f"<WorkerRun {self.id} run {self.run_id} {phase} on {self.worker_address}>"

    @property
    def id(self) -> str:
        return self.run_spec.id

    @property
    def run_id(self) -> int:
        return self.run_spec.run_id

    @property
    def phase(self) -> RunPhase:
        with self._lock:
            return self._phase

    def _set_phase(self, phase: RunPhase) -> RunPhase:
        with self._lock:
            previous, self._phase = self._phase, phase
            return previous

    def _raise_if_closed(self) -> None:
        if self._closed.is_set():
            raise StaleRunError(f"{self!r} is closed")

    # --- task threads -------------------------------------------------------------------------

    def add_input_blocking(self, flat: int, data: np.ndarray) -> None:
        """Cut input chunk ``flat`` into shards and hand them to their workers.

        Runs in a task thread; waits (one hop to the data plane loop) while this worker's
        send buffer is full.
        """
        self._raise_if_closed()
        spec = self.run_spec.spec
        partial = spec.partial
        data = np.asarray(data)
        expected = partial.input_shape(flat)
        if data.ndim != len(expected) or any(
            n != e for a, (n, e) in enumerate(zip(data.shape, expected))
            if a not in spec.unknown_axes
        ):
            raise RechunkRunError(
                f"Input chunk {partial.input_index(flat)} of rechunk {self.id} has shape "
                f"{data.shape}, expected {expected}"
            )
        local, remote = self._cut_blocking(flat, data)
        if local:
            nbytes = self._store.write_blocking(local)
            with self._lock:
                self._bytes_local += nbytes
        if remote:
            from_thread(self._dataplane.loop, self._comm.put, remote)
        with self._lock:
            self._inputs += 1

    def _cut_blocking(self, flat: int, data: np.ndarray) -> tuple[list[Shard], dict[str, Packed]]:
        spec = self.run_spec
        copy_local = self.storage == "memory"
        local: list[Shard] = []
        remote: defaultdict[str, list[Shard]] = defaultdict(list)
        unknown = spec.spec.unknown_axes
        for out, slices in spec.spec.partial.shards_of_input(flat):
            if not spec.spec.builds(out):
                continue
            view = data[widen(slices, unknown)]
            if spec.worker_for(out) == self.worker_address:
                # the memory store keeps what it gets: copy, so the input chunk can be freed;
                # the disk store copies views into its file itself
                shard = np.array(view, order="C") if copy_local else view
                local.append((out, flat, shard))
            else:
                remote[spec.dataplane_for(out)].append((out, flat, view))
        dtype = spec.spec.dtype
        return local, {addr: pack_blocking(shards, dtype) for addr, shards in remote.items()}

    def get_output_blocking(self, flat: int) -> np.ndarray:
        """Assemble output chunk ``flat`` from its shards. Runs in a task thread."""
        self._raise_if_closed()
        spec = self.run_spec.spec
        partial = spec.partial
        placement = dict(partial.shards_of_output(flat))
        if spec.unknown_axes:
            out, received = self._read_unknown_blocking(flat, placement)
        else:
            out = np.empty(partial.output_shape(flat), dtype=spec.dtype)
            received = self._store.read_into_blocking(flat, out, placement)
        if len(received) != len(placement) or set(received) != set(placement):
            missing = sorted(set(placement) - set(received))
            raise RechunkRunError(
                f"Output chunk {partial.output_index(flat)} of rechunk {self.id} "
                f"(run {self.run_id}) on {self.worker_address} is missing shards from "
                f"input chunks {[partial.input_index(i) for i in missing][:10]}"
            )
        with self._lock:
            self._outputs += 1
        return out

    def _read_unknown_blocking(
        self, flat: int, placement: dict[int, tuple[slice, ...]]
    ) -> tuple[np.ndarray, list[int]]:
        """Output ``flat`` when some axes have unknown chunk sizes: its extent there is the
        shards' (every shard spans its chunk along those axes)."""
        spec = self.run_spec.spec
        shards = self._store.read_blocking(flat)
        shape = spec.partial.output_shape(flat)
        if shards:
            like = shards[0][1].shape
            shape = tuple(like[a] if a in spec.unknown_axes else n for a, n in enumerate(shape))
        out = np.empty(shape, dtype=spec.dtype)
        for input_, array in shards:
            if input_ in placement:
                out[widen(placement[input_], spec.unknown_axes)] = array
        return out, [i for i, _ in shards]

    # --- data plane loop ----------------------------------------------------------------------

    async def receive(self, batch: list[Packed]) -> None:
        """Store shards that arrived from another worker (unpacked and written on the pool)."""
        self._raise_if_closed()
        nbytes = await self._offload.to_thread(self._store_packed_blocking, batch)
        with self._lock:
            self._bytes_received += nbytes

    def _store_packed_blocking(self, batch: list[Packed]) -> int:
        dtype = self.run_spec.spec.dtype
        return self._store.write_blocking(
            shard for packed in batch for shard in unpack_blocking(packed, dtype)
        )

    # --- worker loop --------------------------------------------------------------------------

    async def flush(self) -> None:
        """All inputs were transferred: wait until this worker's sends were delivered."""
        self._raise_if_closed()
        await on_loop(self._dataplane.loop, self._comm.flush)
        self._set_phase(RunPhase.INPUTS_DONE)

    async def close(self) -> bool:
        """Stop sending, free buffered shards and remove spill files.

        Idempotent: returns whether this call closed the run.
        """
        with self._lock:
            if self._closed.is_set():
                return False
            self._closed.set()
        self._set_phase(RunPhase.CLOSED)
        await on_loop(self._dataplane.loop, self._comm.close)
        await self._offload.to_thread(self._store.close_blocking)
        return True

    def statistics(self) -> RunStatistics:
        store = self._store.statistics()
        comm: CommStatistics = self._comm.statistics()
        with self._lock:
            return RunStatistics(
                id=self.id,
                run_id=self.run_id,
                phase=self._phase.value,
                storage=self.storage,
                inputs=self._inputs,
                outputs=self._outputs,
                bytes_local=self._bytes_local,
                bytes_received=self._bytes_received,
                bytes_sent=comm.bytes_sent,
                bytes_spilled=store.bytes_written if store.kind == "disk" else 0,
                bytes_buffered=store.bytes_buffered,
            )
