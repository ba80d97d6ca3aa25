"""One worker's share of one run of a sub-shuffle: cut inputs, buffer pieces, build outputs.

Where it runs: ``add_input_blocking`` and ``get_output_blocking`` in task threads;
``receive`` on the data plane's loop (it hands the write to the offload pool); ``flush`` and
``close`` on the worker's event loop (they hop to the data plane loop and the offload pool).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from dataclasses import astuple, dataclass, field

import numpy as np

from rechunk_p2p.cutting.cutter import InputCutter, position_in
from rechunk_p2p.cutting.joined import JoinedBlocks
from rechunk_p2p.cutting.scratch import CutBuffers
from rechunk_p2p.errors import OutputConsumedError, RechunkRunError, StaleRunError
from rechunk_p2p.offload import OffloadPool, on_loop
from rechunk_p2p.spec import RunId, RunSpec, ShuffleId
from rechunk_p2p.store.base import PieceStore, StoreKind
from rechunk_p2p.transport.comm import CommBuffer, CommStatistics
from rechunk_p2p.transport.dataplane import DataPlane
from rechunk_p2p.transport.wire import Packed, Piece, output_array
from rechunk_p2p.worker.memory_shares import RunMemory
from rechunk_p2p.worker.outputs import RunOutputs
from rechunk_p2p.worker.store_gate import StoreGate
from rechunk_p2p.worker.tuning import TuningHold

logger = logging.getLogger(__name__)


class RunPhase(enum.Enum):
    """Where a run is on one worker. Changed only by :meth:`WorkerRun._set_phase` (or its
    ``_locked`` form), along :data:`_NEXT` (a run is closed once, from either phase, and stays
    closed; a continued run transfers again)."""

    TRANSFERRING = "transferring"
    BARRIER_PASSED = "barrier-passed"
    CLOSED = "closed"


_NEXT: dict[RunPhase, frozenset[RunPhase]] = {
    RunPhase.TRANSFERRING: frozenset(
        {RunPhase.TRANSFERRING, RunPhase.BARRIER_PASSED, RunPhase.CLOSED}
    ),
    RunPhase.BARRIER_PASSED: frozenset(
        {RunPhase.TRANSFERRING, RunPhase.BARRIER_PASSED, RunPhase.CLOSED}
    ),
    RunPhase.CLOSED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class PhaseSeconds:
    """**Immutable.** Where a run's time went on one worker, in seconds summed over threads.

    Attributes
    ----------
    cut
        Task threads cutting input chunks into pieces and packing them (this worker's own
        pieces stored included).
    queue_wait
        Task threads queueing packed pieces for sending: waiting while the send buffer
        was full (back-pressure), and handing the pieces to the data plane's loop.
    send
        Sends in flight on the data plane, summed over concurrent sends (a send's time is
        the peer's receive and store too: the ack comes after them).
    store
        The offload pool writing received batches to the store.
    assemble
        Task threads reading pieces back and assembling output chunks.
    """

    cut: float = 0.0
    queue_wait: float = 0.0
    send: float = 0.0
    store: float = 0.0
    assemble: float = 0.0

    def __add__(self, other: PhaseSeconds) -> PhaseSeconds:
        return PhaseSeconds(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True, slots=True)
class RunStatistics:
    """**Immutable.** What one run did on one worker."""

    shuffle_id: ShuffleId
    run_id: RunId
    phase: str
    storage: StoreKind
    inputs: int
    outputs: int
    bytes_local: int
    bytes_received: int
    bytes_sent: int
    bytes_spilled: int
    bytes_buffered: int
    max_bytes_queued: int = 0  # most bytes this run had queued for sending at once
    messages_sent: int = 0  # batches sent to other workers (one message each)
    max_bytes_stored_in_memory: int = 0  # most piece bytes its store held in memory at once
    phases: PhaseSeconds = field(default_factory=PhaseSeconds)


class WorkerRun:
    """**Thread-safe (guarded by `_lock`).** The state of one run on one worker.

    Parameters
    ----------
    run_spec
        The run.
    worker_address
        This worker.
    store
        Where pieces for this worker's outputs wait until assembly (any kind: the run
        uses what :class:`~rechunk_p2p.store.base.PieceStore` says, and its kind names
        the storage in diagnostics).
    dataplane
        The worker's data plane (send and receive happen on its loop).
    offload
        The pool that writes received pieces into the store.
    comm
        The run's send buffer (confined to the data plane's loop).
    tuning
        The process tuning the run holds while it is open, released when it closes (also
        when freeing its buffers failed).
    recent_outputs
        Outputs assembled last that the run keeps a reference to (one per task thread is
        enough): an output whose task was cancelled by a continuation just after it was
        assembled is kept from them (see :meth:`keep_outputs`).
    memory
        The run's share of the worker's memory budget, which places the outputs a
        continuation moves here (``None``: they go where the store puts them).
    """

    def __init__(
        self,
        run_spec: RunSpec,
        worker_address: str,
        store: PieceStore,
        dataplane: DataPlane,
        offload: OffloadPool,
        comm: CommBuffer,
        tuning: TuningHold | None = None,
        recent_outputs: int = 4,
        memory: RunMemory | None = None,
    ) -> None:
        self.run_spec = run_spec
        self.worker_address = worker_address
        self._dataplane = dataplane
        self._offload = offload
        self._comm = comm
        self._tuning = tuning
        self._memory = memory
        self._lock = threading.Lock()
        self._phase = RunPhase.TRANSFERRING
        self._inputs = 0
        self._outputs = 0
        self._bytes_local = 0
        self._bytes_received = 0
        self._seconds = dict.fromkeys(("cut", "queue_wait", "store", "assemble"), 0.0)
        self._results = RunOutputs(recent_outputs)
        # buffers the task threads cut input chunks into, used again (see InputCutter)
        # (recent_outputs is the worker's number of task threads: a thread's buffer is free
        # again about two inputs later, when that input's batches were delivered); the idle
        # ones stay within the worker's send buffer (comm.buffer-bytes-limit)
        self._gate = StoreGate()  # (the store's users, and a spill: spill_blocking)
        self._cuts = CutBuffers(max_free=recent_outputs + 1, max_free_bytes=dataplane.limiter.limit)
        self._use_store(store)

    def _use_store(self, store: PieceStore) -> None:
        """Keep pieces in ``store`` from now on (at the start, or when a continuation split
        the store: the outputs it moved here spill). The cutter follows what the store keeps
        of this worker's own pieces."""
        self._store = store
        self.storage: StoreKind = store.kind
        self._cutter = InputCutter(self.worker_address, store.kind, store.fills_outputs)

    def __repr__(self) -> str:
        phase = self.phase.value
        return f"<WorkerRun {self.shuffle_id} run {self.run_id} {phase} on {self.worker_address}>"

    @property
    def shuffle_id(self) -> ShuffleId:
        return self.run_spec.shuffle_id

    @property
    def run_id(self) -> RunId:
        return self.run_spec.run_id

    @property
    def phase(self) -> RunPhase:
        with self._lock:
            return self._phase

    def _set_phase(self, phase: RunPhase) -> RunPhase:
        """Move to ``phase``; the phase it left. A closed run raises ``StaleRunError``."""
        with self._lock:
            return self._set_phase_locked(phase)

    def _set_phase_locked(self, phase: RunPhase) -> RunPhase:
        previous = self._phase
        if phase not in _NEXT[previous]:
            raise StaleRunError(  # (not repr(self): it takes the lock held here)
                f"Run {self.run_id} of rechunk {self.shuffle_id} on {self.worker_address} "
                f"cannot go from {previous.value} to {phase.value}"
            )
        self._phase = phase
        return previous

    def _position_in(self, run_spec: RunSpec) -> int:
        return position_in(run_spec, self.worker_address)

    def _raise_if_closed(self) -> None:
        if self.phase is RunPhase.CLOSED:
            raise StaleRunError(f"{self!r} is closed")

    # --- task threads -------------------------------------------------------------------------

    def add_input_blocking(self, flat: int, data: np.ndarray | JoinedBlocks) -> RunId:
        """Cut input chunk ``flat`` into pieces and hand them to their workers; the id of the
        run whose owners it cut for (the run may be continued meanwhile: the barrier then
        runs the transfer again).

        Runs in a task thread; waits while this worker's send buffer is full, and hands the
        pieces to the data plane loop without waiting for it.
        """
        self._raise_if_closed()
        run_spec = self.run_spec  # one spec for the whole cut
        spec = run_spec.spec
        partial = spec.partial
        if not isinstance(data, JoinedBlocks):  # (joined only where a cut needs it)
            data = np.asarray(data)
        expected = partial.input_shape(flat)
        if data.ndim != len(expected) or any(
            n != e
            for a, (n, e) in enumerate(zip(data.shape, expected))
            if a not in spec.unknown_axes
        ):
            raise RechunkRunError(
                f"Input chunk {partial.input_index(flat)} of rechunk {self.shuffle_id} has shape "
                f"{data.shape}, expected {expected}"
            )
        start = time.perf_counter()
        scratch = None
        try:
            with self._gate.shared():  # (a spill changes the store and the cutter)
                plan = self._cutter.in_place(run_spec, flat, data)
                scratch = None if plan is not None else self._cuts.take(data.nbytes)
                local: Packed | list[Packed] | list[Piece]
                if plan is not None:
                    # (a plan is made for a plain array only: in_place)
                    local, remote = self._cutter.send_in_place(run_spec, flat, data, plan)  # type: ignore[arg-type]
                else:
                    local, remote = self._cutter.cut_blocking(run_spec, flat, data, scratch)
                nbytes = self._keep_blocking(flat, local)
            cut = time.perf_counter()
            if remote:
                # the batches viewing the buffer hold it until they are delivered
                self._cuts.hold(scratch, (p for _, p in remote if p.payload.base is scratch))
                self._comm.put_blocking(remote)
        finally:
            self._cuts.release(scratch, scratch)
        with self._lock:
            self._bytes_local += nbytes
            self._inputs += 1
            self._seconds["cut"] += cut - start
            self._seconds["queue_wait"] += time.perf_counter() - cut
        return run_spec.run_id

    def _keep_blocking(self, flat: int, local: list | Packed) -> int:
        """Store input ``flat``'s own pieces ``local``; the bytes accepted."""
        if isinstance(local, Packed):
            local = [local]
        try:
            if local and isinstance(local[0], Packed):
                return self._store.write_packed_blocking(local)
            return self._store.write_blocking(local) if local else 0
        except RechunkRunError as e:  # the run closed during the cut: stale, not failed
            if self.phase is RunPhase.CLOSED and not isinstance(e, StaleRunError):
                raise StaleRunError(f"{self!r} closed while input {flat} was cut") from e
            raise

    def get_output_blocking(self, flat: int) -> np.ndarray:
        """Assemble output chunk ``flat`` from its pieces. Runs in a task thread.

        An output kept from a run this one continues is returned as it was assembled; one
        assembled before and not kept (its pieces are gone) raises
        :class:`OutputConsumedError`.
        """
        self._raise_if_closed()
        kept, consumed = self._results.begin(flat)
        if kept is not None:
            return kept
        if consumed:
            raise OutputConsumedError(
                f"Output chunk {self.run_spec.spec.partial.output_index(flat)} of rechunk "
                f"{self.shuffle_id} was assembled on {self.worker_address} before, and its "
                "result was lost"
            )
        try:
            out = self._assemble_blocking(flat)
        except BaseException:
            self._results.failed(flat)
            raise
        self._results.done(flat, out)
        return out

    def _assemble_blocking(self, flat: int) -> np.ndarray:
        start = time.perf_counter()
        spec = self.run_spec.spec
        partial = spec.partial
        with self._gate.shared():
            out, missing = self._store.assemble_blocking(spec, flat)
        if missing:
            raise RechunkRunError(
                f"Output chunk {partial.output_index(flat)} of rechunk {self.shuffle_id} "
                f"(run {self.run_id}) on {self.worker_address} is missing pieces from "
                f"input chunks {[partial.input_index(i) for i in missing][:10]}"
            )
        with self._lock:
            self._outputs += 1
            self._seconds["assemble"] += time.perf_counter() - start
        return out

    # --- continuation (worker loop) -----------------------------------------------------------

    def continue_as(self, run_spec: RunSpec) -> bool:
        """Go on as ``run_spec``, a run that continues this one (an output owner left, or a
        lost output is assembled again): pieces stored here and outputs assembled here
        stay; nothing more is sent to the workers that left; the transfers run again for
        the moved outputs, and this worker passes a barrier again. Whether it did (not if
        closed, or if ``run_spec`` does not continue this run)."""
        with self._lock:
            if (
                self._phase is RunPhase.CLOSED
                or run_spec.run_id <= self.run_spec.run_id
                or not run_spec.accepts(self.run_spec.run_id)
            ):
                return False
            departed = set(self.run_spec.dataplanes) - set(run_spec.dataplanes)
            # an output assembled here before that comes back to be assembled again (its
            # result was lost): its pieces are sent anew, and stored as new ones (a few
            # outputs' bookkeeping under the store's lock, rare: on the worker's loop)
            mine = [
                flat
                for flat in run_spec.reassigned(self.run_spec)
                if run_spec.worker_for(flat) == self.worker_address
            ]
            self._results.take_back(mine, self._store.forget_outputs_blocking)
            self._take_moved(run_spec)
            self.run_spec = run_spec  # (after the store: a receiver reads the spec first)
            self._set_phase_locked(RunPhase.TRANSFERRING)
        if departed:  # the comm buffer is confined to the data plane's loop
            with contextlib.suppress(RuntimeError):  # closed: the worker is going
                self._dataplane.loop.call_soon_threadsafe(self._comm.forget, departed)
        return True

    def _take_moved(self, run_spec: RunSpec) -> None:
        """The outputs ``run_spec`` moves to this worker wait in memory while the worker's
        budget has room, else on disk (under ``_lock``, before the continued run's pieces
        can come)."""
        if self._memory is None:
            return
        mine = [
            f
            for f in run_spec.reassigned(self.run_spec)
            if run_spec.worker_for(f) == self.worker_address
        ]
        store = self._memory.take_moved(self._store, run_spec, mine)
        if store is not self._store:
            self._use_store(store)

    def spill_blocking(self) -> int:
        """Move the pieces this run holds in memory to disk, and spill every piece that
        comes from now on (distributed paused the worker: it is short of memory); the bytes
        moved. Runs in the offload pool; the store's users wait meanwhile. The caller gives
        back the run's share of the memory budget (:meth:`release_memory`)."""
        if self._memory is None:
            return 0
        with self._gate.sole():
            with self._lock:  # (as a continuation changes the store: continue_as)
                if self._phase is RunPhase.CLOSED:
                    return 0
                store = self._memory.spillable(self._store, self.run_spec)
                if store is not self._store:
                    self._use_store(store)
            try:
                return store.spill_blocking()
            except RechunkRunError:
                if self.phase is RunPhase.CLOSED:  # closed meanwhile: nothing to keep
                    return 0
                raise

    def release_memory(self) -> None:
        """Give back the run's share of the worker's memory budget (it spilled its pieces).
        On the worker's loop."""
        if self._memory is not None:
            self._memory.release()

    def keep_outputs(self, outputs: list[int], held: dict[int, np.ndarray]) -> int:
        """Keep the results of ``outputs`` for the continued run's tasks of the same outputs.

        The scheduler releases their tasks as it continues the run, and the worker drops their
        results, but their pieces are gone. ``held`` are results the worker holds; the others
        are taken from the outputs assembled last, or kept when their assembly, running now,
        finishes (:meth:`RunOutputs.keep`). Returns how many were kept now.
        """
        return self._results.keep(outputs, held)

    # --- data plane loop ----------------------------------------------------------------------

    async def receive(self, batch: list[Packed]) -> bool:
        """Store pieces that arrived from another worker (unpacked and written on the pool).
        Returns whether the store copied them out, so that nothing refers to the batches'
        payloads any more (the data plane then reads later messages into them)."""
        self._raise_if_closed()
        nbytes = await self._offload.to_thread(self._store_packed_blocking, batch)
        with self._lock:
            self._bytes_received += nbytes
        return self._store.copies_pieces

    def _store_packed_blocking(self, batch: list[Packed]) -> int:
        start = time.perf_counter()
        self._check_owned_blocking(batch)
        with self._gate.shared():
            nbytes = self._store.write_packed_blocking(batch)
        with self._lock:
            self._seconds["store"] += time.perf_counter() - start
        return nbytes

    def _check_owned_blocking(self, batch: list[Packed]) -> None:
        """Refuse pieces of outputs this worker does not assemble (a sender that addressed the
        wrong data plane): stored here they would be lost, and their owner would miss them.
        Pieces of an output a continuation moved away from here are kept (a batch cut before
        the continuation and sent under its id): the continued run's transfers send that
        output's pieces to its new worker, and what is kept here is dropped at the close."""
        run_spec = self.run_spec
        outputs = (
            np.concatenate([output_array(p) for p in batch])
            if batch
            else np.zeros(0, dtype=np.int64)
        )
        positions = run_spec.owner_positions(outputs)
        elsewhere = positions != self._position_in(run_spec)
        wrong = np.flatnonzero(elsewhere & ~run_spec.were_moved(outputs))
        if len(wrong):
            first, position = int(outputs[wrong[0]]), int(positions[wrong[0]])
            owner = run_spec.workers[position] if position >= 0 else "no worker of the run"
            raise RechunkRunError(
                f"{len(wrong)} pieces of rechunk {self.shuffle_id} (run {self.run_id}) reached "
                f"{self.worker_address}, which does not assemble their outputs (output "
                f"{first} belongs to {owner}); refused"
            )

    def sent(self, batch: list[Packed]) -> None:
        """Batches were delivered (the receiver stored them): the cut buffers they view may
        be used again. Runs on the data plane's loop."""
        for packed in batch:
            self._cuts.release(packed.payload.base, packed)

    # --- worker loop --------------------------------------------------------------------------

    async def pass_barrier(self) -> None:
        """The barrier: all inputs were transferred; wait until this worker's sends arrived."""
        self._raise_if_closed()
        await on_loop(self._dataplane.loop, self._comm.flush)
        self._set_phase(RunPhase.BARRIER_PASSED)
        self._cuts.close()  # no more inputs

    async def close(self) -> bool:
        """Stop sending, free buffered pieces and remove spill files.

        Idempotent: returns whether this call closed the run (the run is closed then even
        if freeing raised).
        """
        try:
            self._set_phase(RunPhase.CLOSED)
        except StaleRunError:
            return False  # closed already
        self._results.clear()
        self._cuts.close()
        try:
            await on_loop(self._dataplane.loop, self._comm.close)
        finally:
            try:
                await self._offload.to_thread(self._store.close_blocking)
            finally:
                if self._memory is not None:
                    self._memory.release()
                if self._tuning is not None:
                    await self._tuning.release_and_tidy(self._offload)
        return True

    def statistics(self) -> RunStatistics:
        store = self._store.statistics()
        comm: CommStatistics = self._comm.statistics()
        with self._lock:
            return RunStatistics(
                shuffle_id=self.shuffle_id,
                run_id=self.run_id,
                phase=self._phase.value,
                storage=self.storage,
                inputs=self._inputs,
                outputs=self._outputs,
                bytes_local=self._bytes_local,
                bytes_received=self._bytes_received,
                bytes_sent=comm.bytes_sent,
                bytes_spilled=store.bytes_spilled,
                bytes_buffered=store.bytes_buffered,
                max_bytes_queued=comm.max_bytes_queued,
                messages_sent=comm.messages,
                max_bytes_stored_in_memory=store.max_bytes_in_memory,
                phases=PhaseSeconds(send=comm.send_seconds, **self._seconds),
            )
