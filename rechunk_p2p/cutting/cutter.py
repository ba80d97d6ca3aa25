"""Cutting an input chunk into pieces, grouped by the worker each goes to.

Where it runs: task threads (a transfer task's cut, for :class:`~rechunk_p2p.worker.run.
WorkerRun`); the destinations cache is shared by a run's threads under a lock.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import numpy as np

from rechunk_p2p.cutting.in_place import Block, plan_blocks
from rechunk_p2p.cutting.joined import JoinedBlocks
from rechunk_p2p.cutting.regular import cut_regular_blocking, regular_grid
from rechunk_p2p.spec import RunSpec
from rechunk_p2p.transport.wire import Packed, Piece, pack_blocking, pack_blocks, pack_box

#: Per worker position, the blocks of an input chunk that hold its pieces there; and the
#: pieces' shape (see :meth:`InputCutter.in_place`)
InPlace = tuple[tuple[int, ...], list[tuple[int, list[Block]]]]


def position_in(run_spec: RunSpec, address: str) -> int:
    """The position of the worker at ``address`` in ``run_spec``; -2 for a worker that
    joined after the run started (it owns nothing and sends everything)."""
    workers = run_spec.workers
    return workers.index(address) if address in workers else -2


class InputCutter:
    """**Thread-safe.** Cuts one run's input chunks on one worker: the pieces that stay
    here, and one batch per other worker.

    ``storage`` and ``assembles`` say what the run's store keeps of this worker's own
    pieces: a store that copies pieces into their outputs as they come (``assembles``)
    takes views of the cut; any other store keeps what it is given, so it gets copies (the
    memory store as a list of pieces, the others as one batch).
    """

    def __init__(self, worker_address: str, storage: str, assembles: bool) -> None:
        self.worker_address = worker_address
        self.storage = storage
        self._assembles = assembles
        self._lock = threading.Lock()
        # (id of an outputs array, run id) -> (the array, its destinations): see _destinations
        self._sends: dict[tuple[int, int], tuple[np.ndarray, list]] = {}
        # (id of an outputs array, run id, the chunk's shape and itemsize) -> (the array,
        # its blocks or None): see in_place
        self._plans: dict[tuple, tuple[np.ndarray, InPlace | None]] = {}

    def in_place(
        self, run_spec: RunSpec, flat: int, data: np.ndarray | JoinedBlocks
    ) -> InPlace | None:
        """How input ``flat``'s chunk ``data`` sends its pieces without a cut (each worker's
        as blocks of the chunk: :mod:`rechunk_p2p.cutting.in_place`), or ``None`` to cut it.

        Only where this worker's store copies pieces into their outputs as they come (so
        its own pieces need no copy of their own either), and for a C-contiguous chunk of
        the run's dtype cut regularly. A peer whose store keeps what it is given (each
        worker chooses its store) lays the pieces out one after another first
        (:func:`~rechunk_p2p.transport.wire.in_order`). The plan is the same for every
        chunk of one shape cut alike, and is kept per run as :meth:`_destinations` are.
        """
        spec = run_spec.spec
        if not (
            self._assembles
            and isinstance(data, np.ndarray)
            and data.dtype == spec.dtype
            and not data.dtype.hasobject
            and data.size
            and data.ndim
            and data.flags.c_contiguous
        ):
            return None
        outputs = spec.partial.input_outputs(flat)
        key = (id(outputs), run_spec.run_id, data.shape, data.itemsize)
        if not run_spec.lineage:
            with self._lock:
                hit = self._plans.get(key)
            if hit is not None and hit[0] is outputs:
                return hit[1]
        _, slices = spec.partial.input_cuts(flat)
        slices = [[slice(None)] if a in spec.unknown_axes else s for a, s in enumerate(slices)]
        grid = regular_grid(data.shape, slices, spec.partial.input_cut_lengths(flat))
        plan: InPlace | None = None
        if grid is not None:
            counts, lengths = grid
            sends = []
            for position, chosen in self._destinations(run_spec, flat, outputs):
                blocks = plan_blocks(data.shape, data.itemsize, counts, lengths, chosen)
                if blocks is None:
                    break
                sends.append((position, blocks))
            else:
                plan = (tuple(lengths), sends)
        if not run_spec.lineage:
            with self._lock:
                self._plans[key] = (outputs, plan)
        return plan

    def send_in_place(
        self, run_spec: RunSpec, flat: int, data: np.ndarray, plan: InPlace
    ) -> tuple[list[Packed], list[tuple[str, Packed]]]:
        """:meth:`cut_blocking` without the cut, by ``plan`` (:meth:`in_place`): every
        batch views a block of ``data``, this worker's as the others' (the store copies
        its pieces into their outputs at once)."""
        outputs = run_spec.spec.partial.input_outputs(flat)
        me = position_in(run_spec, self.worker_address)
        shape, sends = plan
        local: list[Packed] = []
        remote: list[tuple[str, Packed]] = []
        for position, blocks in sends:
            for chosen, slices, along in blocks:
                packed = pack_box(outputs[chosen], flat, data[slices], along, shape)
                if position == me:
                    local.append(packed)
                else:
                    remote.append((run_spec.dataplanes[position], packed))
        return local, remote

    def cut_blocking(
        self,
        run_spec: RunSpec,
        flat: int,
        data: np.ndarray | JoinedBlocks,
        scratch: np.ndarray | None = None,
    ) -> tuple[Packed | list[Piece], list[tuple[str, Packed]]]:
        """The pieces of input ``flat`` that stay here, and one batch per other worker (with
        its data plane's address).

        Regular cuts (pieces of one length along each axis, the usual case) are done for the
        whole chunk at once: one strided copy lays every piece out contiguously, grouped by
        destination, and each batch's payload is a view of that copy. Other cuts are copied
        piece by piece.

        With ``scratch`` (a buffer of :class:`CutBuffers`, used again once this input's
        batches are delivered) the strided copy goes there, and the other workers' batches
        view it; this worker's pieces are copied out of it for a store that keeps what it
        is given (the assembling store copies them into their outputs at once).
        """
        spec = run_spec.spec
        _, slices = spec.partial.input_cuts(flat)
        slices = [[slice(None)] if a in spec.unknown_axes else s for a, s in enumerate(slices)]
        outputs = spec.partial.input_outputs(flat)
        me = position_in(run_spec, self.worker_address)
        lengths = spec.partial.input_cut_lengths(flat)
        blocks = cut_regular_blocking(data, slices, spec.dtype, out=scratch, lengths=lengths)
        if blocks is None:
            data = np.asarray(data)
            positions = run_spec.send_positions(flat, outputs)
            return self._cut_each_blocking(run_spec, flat, data, outputs, slices, positions, me)
        local: list[Piece] = []
        here: Packed | None = None
        remote: list[tuple[str, Packed]] = []
        for position, chosen in self._destinations(run_spec, flat, outputs):
            lo, hi = int(chosen[0]), int(chosen[-1]) + 1
            part = blocks[lo:hi] if hi - lo == len(chosen) else blocks[chosen]
            if position != me:
                packed = pack_blocks(outputs[chosen], flat, part, spec.dtype)
                remote.append((run_spec.dataplanes[position], packed))
                continue
            if not self._assembles:
                # the store keeps it (memory, or the disk store's write buffer): a copy of
                # its own, not a view of the buffer the next input is cut into
                part = part.copy()
            if self.storage == "memory" and not self._assembles:
                local.extend(zip(outputs[chosen].tolist(), [flat] * len(chosen), part))
            else:  # stored as one batch, as a received one is
                here = pack_blocks(outputs[chosen], flat, part, spec.dtype)
        return (local if here is None else here), remote

    def _destinations(
        self, run_spec: RunSpec, flat: int, outputs: np.ndarray
    ) -> list[tuple[int, np.ndarray]]:
        """Per worker position that input ``flat`` sends pieces to, the positions among
        ``outputs`` of those pieces: the same for every input cut alike in a run that
        continues none (computed once per cut then; ``outputs`` is the partial's shared
        array), else per input (a continued run sends only some inputs' pieces)."""
        key = (id(outputs), run_spec.run_id)
        if not run_spec.lineage:
            with self._lock:
                hit = self._sends.get(key)
            if hit is not None and hit[0] is outputs:
                return hit[1]
        positions = run_spec.send_positions(flat, outputs)
        found = [
            (position, np.flatnonzero(positions == position))
            for position in np.unique(positions[positions >= 0]).tolist()
        ]
        if not run_spec.lineage:
            with self._lock:
                self._sends[key] = (outputs, found)
        return found

    def _cut_each_blocking(
        self,
        run_spec: RunSpec,
        flat: int,
        data: np.ndarray,
        outputs: np.ndarray,
        slices: list[list[slice]],
        positions: np.ndarray,
        me: int,
    ) -> tuple[list[Piece], list[tuple[str, Packed]]]:
        """:meth:`cut_blocking` piece by piece (irregular cuts, object dtype)."""
        copy_local = self.storage == "memory" and not self._assembles
        local: list[Piece] = []
        remote: defaultdict[str, list[Piece]] = defaultdict(list)
        for out, position, piece in zip(
            outputs.tolist(), positions.tolist(), itertools.product(*slices)
        ):
            if position < 0:
                continue  # culled away
            view = data[piece]
            if position == me:
                # the memory store keeps what it gets: copy, so the input chunk can be freed;
                # the disk store copies views into its file itself
                local.append((out, flat, np.array(view, order="C") if copy_local else view))
            else:
                remote[run_spec.dataplanes[position]].append((out, flat, view))
        dtype = run_spec.spec.dtype
        return local, [(addr, pack_blocking(pieces, dtype)) for addr, pieces in remote.items()]
