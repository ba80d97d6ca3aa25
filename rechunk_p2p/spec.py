"""What a rechunk run does: the frozen, picklable specs that travel between processes.

Where it runs: pure. A :class:`ShuffleSpec` is built on the client and rides in the graph on
the barrier task; the scheduler turns it into a :class:`RunSpec` (adding the run id and the
workers) for every attempt to run it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NewType

import numpy as np
from dask.utils import key_split

from rechunk_p2p.config import Storage
from rechunk_p2p.planning import Partial, assign_worker, proportional_blocks

#: Key prefixes of the engine's tasks, all different from distributed's own P2P keys
#: (``rechunk-p2p-<token>``, ``rechunk-transfer-``, ``shuffle-barrier-``), so the dashboard and
#: the keys show which engine ran. The output's name starts with ``rechunk-p2p`` as any P2P
#: rechunk's does (dask's and distributed's tests look for it); the engine's intermediate
#: tasks (and rechunk_zarr's write and finish tasks) are named after the package,
#: ``rechunk_p2p-<role>``: ``key_split`` stops at the underscore word, so a transfer fused
#: with its input keeps the input's group, and the dashboard groups them by role.
BARRIER_PREFIX = "rechunk_p2p-barrier-"
TRANSFER_PREFIX = "rechunk_p2p-transfer-"
JOINED_PREFIX = "rechunk_p2p-joined-"
HELD_PREFIX = "rechunk_p2p-held-"
OUTPUT_PREFIX = "rechunk-p2p-out-"

Slices = tuple[slice, ...]

ShuffleId = NewType("ShuffleId", str)
"""One sub-shuffle of one rechunk: ``<token>-<partial index>`` (plus a digest when culled)."""
RunId = NewType("RunId", int)
"""One attempt to run a sub-shuffle; increases with every restart (scheduler-wide)."""

#: Name of the scheduler plugin and of the worker plugin.
PLUGIN_NAME = "rechunk-p2p"
#: Scheduler metadata key under which each worker publishes its data-plane address.
METADATA_KEY = "rechunk-p2p-dataplane"
#: Key of a transfer task's metadata (sent with its result's task-finished message) naming
#: the run it cut its inputs for.
RUN_METADATA = "rechunk-p2p-run"
#: Key of an unpack task's metadata naming the output it assembled (``[shuffle id, run id,
#: flat index]``): the scheduler learns which outputs' pieces are consumed.
OUTPUT_METADATA = "rechunk-p2p-output"


#: Longest transfer name led by the input's key group (dask cuts fused names at 115 characters)
_MAX_LED_NAME = 110


def transfer_name(input_name: str, token: str) -> str:
    """The name of a rechunk's transfer keys: ``<input's group>-rechunk_p2p-transfer-<token>``.

    Led by the input's key group, a transfer key is the key that dask's linear fusion gives
    an input task fused with its transfer (it names a fused chain after the top key when all
    other keys of the chain are in the top key's group), so fusion adds no alias task per
    input chunk. The name falls back to ``rechunk_p2p-transfer-<token>`` where that cannot
    hold.

    >>> transfer_name("random_sample-4a5b", "0f1e")
    'random_sample-rechunk_p2p-transfer-0f1e'
    >>> key_split(transfer_name("random_sample-4a5b", "0f1e"))
    'random_sample'
    """
    group = key_split(input_name)
    name = f"{group}-{TRANSFER_PREFIX}{token}"
    if key_split(name) == group and len(name) + 13 <= _MAX_LED_NAME:  # 13: a culled suffix
        return name
    return TRANSFER_PREFIX + token


def barrier_key(shuffle_id: ShuffleId) -> str:
    """The key of the barrier task of one sub-shuffle."""
    return BARRIER_PREFIX + shuffle_id


def id_from_key(key: object) -> ShuffleId | None:
    """The shuffle id of a barrier key, or None for any other key."""
    if isinstance(key, str) and key.startswith(BARRIER_PREFIX):
        return ShuffleId(key[len(BARRIER_PREFIX) :])
    return None


def widen(slices: Slices, axes: tuple[int, ...]) -> Slices:
    """``slices`` with a whole-axis slice along ``axes`` (axes of unknown chunk sizes).

    Along such an axis the plan counts every chunk as one element; the data's real extent is
    only known to the task that holds it, and a piece always spans its chunk there.

    >>> widen((slice(0, 1), slice(2, 4)), (0,))
    (slice(None, None, None), slice(2, 4, None))
    """
    if not axes:
        return slices
    return tuple(slice(None) if a in axes else s for a, s in enumerate(slices))


@dataclass(frozen=True)
class ShuffleSpec:
    """**Immutable.** One sub-shuffle of a rechunk, independent of any attempt to run it.

    Parameters
    ----------
    shuffle_id
        Unique id (``<token>-<partial index>``, plus a digest of ``keep`` when culled).
    partial
        The partial: its input and output chunks (one element per chunk along
        ``unknown_axes``).
    dtype
        The array's dtype.
    storage
        ``"disk"``, ``"memory"`` or ``"auto"`` (read from config on the client).
    output_name
        Name of the output array (the unpack tasks' keys are ``(output_name, *index)``).
    keep
        Flat indices of the outputs to build (a graph culled to part of the output), or
        ``None`` for all of them. Inputs that touch none of them are not transferred.
    unknown_axes
        Axes of unknown (NaN) chunk sizes; chunks are unchanged along them.
    send_buffer_bytes
        Bytes of this sub-shuffle's pieces a worker may hold queued for sending (a memory
        budget such as ``rechunk_zarr``'s ``max_mem``), on top of the worker's own
        ``comm.buffer-bytes-limit``; ``None``: that limit alone.
    transfer_groups
        The inputs each transfer task cuts, in the order of the barrier's dependencies, where
        one task cuts several held chunks (:mod:`rechunk_p2p.holders`; its key is
        ``(name, group index)``); ``None``: one transfer an input (key ``(name, *index)``).
    label
        What the user calls the input: dask's name of the input array without its token
        (``open_dataset-t2m`` for an xarray variable ``t2m``), for the dashboard and
        messages.
    """

    shuffle_id: ShuffleId
    partial: Partial
    dtype: np.dtype
    storage: Storage
    output_name: str
    keep: frozenset[int] | None = None
    unknown_axes: tuple[int, ...] = ()
    send_buffer_bytes: int | None = None
    transfer_groups: tuple[tuple[int, ...], ...] | None = None
    label: str = ""

    def output_key(self, flat: int) -> tuple:
        """The key of the unpack task of output ``flat``."""
        return (self.output_name, *self.partial.output_index(flat))

    @cached_property
    def outputs(self) -> tuple[int, ...]:
        """Flat indices of the outputs this sub-shuffle builds, ascending."""
        if self.keep is None:
            return tuple(range(self.partial.n_outputs))
        return tuple(sorted(self.keep))

    @cached_property
    def inputs(self) -> tuple[int, ...]:
        """Flat indices of the inputs with a piece for one of :attr:`outputs`, ascending."""
        if self.keep is None:
            return tuple(range(self.partial.n_inputs))
        needed = {i for out in self.keep for i, _ in self.partial.pieces_of_output(out)}
        return tuple(sorted(needed))

    @cached_property
    def transfers(self) -> tuple[tuple[int, ...], ...]:
        """The inputs of each transfer task, in the order of the barrier's dependencies."""
        if self.transfer_groups is not None:
            return self.transfer_groups
        return tuple((i,) for i in self.inputs)

    def transfer_of(self, key: tuple) -> int:
        """The position among :attr:`transfers` of the transfer task of ``key``."""
        if self.transfer_groups is not None:
            return int(key[-1])
        return bisect.bisect_left(self.inputs, self.partial.flat_input(tuple(key[1:])))

    @cached_property
    def _rank(self) -> dict[int, int] | None:
        return None if self.keep is None else {o: r for r, o in enumerate(self.outputs)}

    @cached_property
    def outputs_array(self) -> np.ndarray:
        """:attr:`outputs` as an array."""
        return np.asarray(self.outputs, dtype=np.int64)

    def builds(self, flat: int) -> bool:
        """Whether output ``flat`` is built (not culled away)."""
        return self.keep is None or flat in self.keep

    def rank(self, flat: int) -> int:
        """Position of output ``flat`` among :attr:`outputs`."""
        return flat if self._rank is None else self._rank[flat]

    @property
    def nbytes(self) -> int:
        """Bytes the sub-shuffle moves, at most (8 bytes an element for object dtype)."""
        itemsize = 8 if self.dtype.hasobject else max(self.dtype.itemsize, 1)
        share = len(self.inputs) / max(self.partial.n_inputs, 1)
        return int(self.partial.size * itemsize * share)


@dataclass(frozen=True)
class RunSpec:
    """**Immutable.** One attempt to run a sub-shuffle: the spec, a run id and its workers.

    The built outputs, in ascending order, are split into contiguous balanced blocks, one per
    worker, rotated by ``shift``; ``dataplanes[k]`` is the data plane address of
    ``workers[k]``. A run that continues earlier ones after an output owner left (see
    :meth:`continued_without`) has its ownership as a table instead: the outputs of the
    workers that left are moved to the others, every other output keeps its worker.

    Parameters
    ----------
    table
        Position (in ``workers``) of the worker of each built output, in the order of
        ``spec.outputs``; ``None``: the balanced blocks above.
    lineage
        The runs this one continues, oldest first: their pieces and their finished outputs
        are kept, and their messages are accepted.
    moved
        Flat indices of the outputs that changed worker in a continuation (cumulative): a
        continued run's transfers send only their pieces, every other piece was delivered
        (or is queued on a worker still there)...
    resend_all
        ... but for these inputs, whose earlier pieces may have been lost (their transfer
        ran on the worker that left, or had not finished): their transfers send every piece
        again (receivers drop the ones they hold).
    """

    spec: ShuffleSpec
    run_id: RunId
    workers: tuple[str, ...]
    dataplanes: tuple[str, ...]
    shift: int
    table: tuple[int, ...] | None = None
    lineage: tuple[RunId, ...] = ()
    moved: frozenset[int] = frozenset()
    resend_all: frozenset[int] = frozenset()

    @classmethod
    def first(
        cls,
        spec: ShuffleSpec,
        run_id: RunId,
        workers: tuple[str, ...],
        dataplanes: tuple[str, ...],
        shift: int,
        weights: Sequence[float] | None = None,
    ) -> RunSpec:
        """The first run of ``spec``: outputs in contiguous blocks rotated by ``shift``, each
        worker's block in proportion to its weight in ``weights`` (its memory limit, say;
        ``None``: balanced blocks, as for equal weights).

        >>> from rechunk_p2p.planning import make_partials
        >>> (p,) = make_partials(((4,), (10,)), ((4,), (1,) * 10))
        >>> spec = ShuffleSpec(ShuffleId("s-0"), p, np.dtype("f8"), "memory", "out")
        >>> run = RunSpec.first(spec, RunId(1), ("a", "b"), ("A", "B"), 1, weights=(2, 8))
        >>> "".join(run.worker_for(i) for i in range(10))
        'bbbbbbbbaa'
        """
        if weights is None or len(set(weights)) <= 1:
            return cls(spec, run_id, workers, dataplanes, shift)
        order = (np.arange(len(workers)) + shift) % len(workers)
        blocks = proportional_blocks(len(spec.outputs), [weights[k] for k in order.tolist()])
        return cls(spec, run_id, workers, dataplanes, 0, tuple(order[blocks].tolist()))

    @property
    def shuffle_id(self) -> ShuffleId:
        return self.spec.shuffle_id

    @cached_property
    def _table(self) -> np.ndarray | None:
        return None if self.table is None else np.asarray(self.table, dtype=np.int64)

    @cached_property
    def _moved(self) -> np.ndarray:
        return np.asarray(sorted(self.moved), dtype=np.int64)

    def accepts(self, run_id: RunId) -> bool:
        """Whether messages of run ``run_id`` belong to this run (it, or one it continues)."""
        return run_id == self.run_id or run_id in self.lineage

    def worker_position(self, flat: int) -> int:
        spec = self.spec
        if self._table is not None:
            return int(self._table[spec.rank(flat)])
        return assign_worker(spec.rank(flat), len(spec.outputs), len(self.workers), self.shift)

    def worker_positions(self, flats: np.ndarray) -> np.ndarray:
        """:meth:`worker_position` of many outputs at once (all built ones)."""
        spec = self.spec
        ranks = flats if spec.keep is None else np.searchsorted(spec.outputs_array, flats)
        if self._table is not None:
            return self._table[ranks]
        n, w = max(len(spec.outputs), 1), len(self.workers)
        return (ranks * w // n + self.shift) % w

    def owner_positions(self, flats: np.ndarray) -> np.ndarray:
        """:meth:`worker_position` of many outputs, ``-1`` for those not built (culled away,
        or not outputs of the sub-shuffle at all)."""
        spec = self.spec
        if spec.keep is None:
            built = (flats >= 0) & (flats < spec.partial.n_outputs)
        else:
            built = np.isin(flats, spec.outputs_array)
        positions = np.full(len(flats), -1, dtype=np.int64)
        positions[built] = self.worker_positions(flats[built])
        return positions

    def send_positions(self, input_: int, flats: np.ndarray) -> np.ndarray:
        """:meth:`owner_positions` of the outputs the transfer of input ``input_`` sends
        pieces of (``flats``: outputs it has pieces of), ``-1`` for the others: in a continued
        run, only the moved outputs' pieces, unless the input is in :attr:`resend_all`."""
        positions = self.owner_positions(flats)
        if self.lineage and input_ not in self.resend_all:
            positions[~np.isin(flats, self._moved)] = -1
        return positions

    def were_moved(self, flats: np.ndarray) -> np.ndarray:
        """Whether each of ``flats`` changed worker in a continuation of the lineage."""
        return np.isin(flats, self._moved)

    def owners(self) -> frozenset[str]:
        """The workers that assemble at least one output of the run."""
        spec = self.spec
        if not spec.outputs:
            return frozenset()
        positions = np.unique(self.worker_positions(np.asarray(spec.outputs, dtype=np.int64)))
        return frozenset(self.workers[p] for p in positions.tolist())

    def worker_for(self, flat: int) -> str:
        """The worker that assembles output ``flat``."""
        return self.workers[self.worker_position(flat)]

    def continued(self, run_id: RunId, resend_all: frozenset[int]) -> RunSpec:
        """The run that continues this one with every output where it is: after a worker
        that assembles none left while pieces it had cut in full waited in its send queues.
        ``resend_all``: see the class.

        >>> from rechunk_p2p.planning import make_partials
        >>> (p,) = make_partials(((4,), (6,)), ((4,), (1,) * 6))
        >>> spec = ShuffleSpec(ShuffleId("s-0"), p, np.dtype("f8"), "memory", "out")
        >>> run = RunSpec(spec, RunId(1), ("a", "b"), ("A", "B"), shift=0)
        >>> after = run.continued(RunId(2), frozenset({0}))
        >>> [after.worker_for(i) for i in range(6)], after.lineage, sorted(after.resend_all)
        (['a', 'a', 'a', 'b', 'b', 'b'], (1,), [0])
        """
        return replace(
            self, run_id=run_id, lineage=(*self.lineage, self.run_id), resend_all=resend_all
        )

    def continued_without(
        self,
        worker: str,
        run_id: RunId,
        resend_all: frozenset[int] = frozenset(),
        remake: frozenset[int] = frozenset(),
        weights: Sequence[float] | None = None,
    ) -> RunSpec:
        """The run that continues this one after ``worker``, an owner, left.

        Its outputs move to the other workers, split in contiguous blocks (one per worker, in
        order, in proportion to ``weights``, one for each other worker); every other output
        keeps its worker, and with it the pieces delivered there and the outputs finished
        there, but for ``remake``: other workers' outputs to assemble again (see
        :meth:`remaking`), each on the worker after its own. ``resend_all``: see the class.

        >>> from rechunk_p2p.planning import make_partials
        >>> (p,) = make_partials(((4,), (6,)), ((4,), (1,) * 6))
        >>> spec = ShuffleSpec(ShuffleId("s-0"), p, np.dtype("f8"), "memory", "out")
        >>> run = RunSpec(spec, RunId(1), ("a", "b", "c"), ("A", "B", "C"), shift=0)
        >>> [run.worker_for(i) for i in range(6)]
        ['a', 'a', 'b', 'b', 'c', 'c']
        >>> after = run.continued_without("b", RunId(2))
        >>> [after.worker_for(i) for i in range(6)], sorted(after.moved), after.lineage
        (['a', 'a', 'a', 'c', 'c', 'c'], [2, 3], (1,))
        >>> again = run.continued_without("b", RunId(2), remake=frozenset({0, 5}))
        >>> [again.worker_for(i) for i in range(6)], sorted(again.moved)
        (['c', 'a', 'a', 'c', 'c', 'a'], [0, 2, 3, 5])
        """
        lost = self.workers.index(worker)
        positions = self.worker_positions(self.spec.outputs_array)
        moving = np.flatnonzero(positions == lost)
        survivors = [k for k in range(len(self.workers)) if k != lost]
        renumber = np.full(len(self.workers), -1, dtype=np.int64)
        renumber[survivors] = np.arange(len(survivors))
        table = renumber[positions]
        table[moving] = proportional_blocks(len(moving), weights or (1,) * len(survivors))
        again = np.searchsorted(self.spec.outputs_array, sorted(remake)).astype(np.int64)
        again = again[positions[again] != lost]
        table[again] = (table[again] + 1) % len(survivors)
        moved = self.spec.outputs_array[np.concatenate([moving, again])].tolist()
        return RunSpec(
            spec=self.spec,
            run_id=run_id,
            workers=tuple(self.workers[k] for k in survivors),
            dataplanes=tuple(self.dataplanes[k] for k in survivors),
            shift=0,
            table=tuple(table.tolist()),
            lineage=(*self.lineage, self.run_id),
            moved=self.moved | frozenset(moved),
            resend_all=resend_all,
        )

    def continued_with(
        self,
        workers: tuple[str, ...],
        dataplanes: tuple[str, ...],
        run_id: RunId,
        resend_all: frozenset[int] = frozenset(),
        fixed: frozenset[int] = frozenset(),
        weights: Sequence[float] | None = None,
    ) -> RunSpec:
        """The run that continues this one with ``workers`` joined (``dataplanes``: theirs):
        each worker of the run keeps at most its fair share of the outputs (over the grown
        worker set, in proportion to ``weights``, one for each worker of the grown set, and
        rounded up), giving the rest from the end of its block, and the joined workers take
        what is given in contiguous blocks (in proportion to their weights). ``fixed``
        outputs (assembled already) keep their worker. ``resend_all``: see the class.

        >>> from rechunk_p2p.planning import make_partials
        >>> (p,) = make_partials(((4,), (8,)), ((4,), (1,) * 8))
        >>> spec = ShuffleSpec(ShuffleId("s-0"), p, np.dtype("f8"), "memory", "out")
        >>> run = RunSpec(spec, RunId(1), ("a",), ("A",), shift=0)
        >>> after = run.continued_with(("b", "c", "d"), ("B", "C", "D"), RunId(2))
        >>> [after.worker_for(i) for i in range(8)], sorted(after.moved), after.lineage
        (['a', 'a', 'b', 'b', 'c', 'c', 'd', 'd'], [2, 3, 4, 5, 6, 7], (1,))
        """
        outputs = self.spec.outputs_array
        positions = self.worker_positions(outputs)
        old, new = len(self.workers), len(self.workers) + len(workers)
        weight = np.asarray(weights or (1,) * new, dtype=np.float64)
        shares = np.ceil(np.round(len(outputs) * weight / weight.sum(), 9)).astype(np.int64)
        fixed_ranks = np.isin(outputs, np.asarray(sorted(fixed), dtype=np.int64))
        given = []
        for k in range(old):
            mine = np.flatnonzero(positions == k)
            movable = mine[~fixed_ranks[mine]]
            excess = min(len(mine) - int(shares[k]), len(movable))
            if excess > 0:
                given.append(movable[len(movable) - excess :])
        table = positions.copy()
        moving = np.sort(np.concatenate(given)) if given else np.empty(0, dtype=np.int64)
        table[moving] = old + proportional_blocks(len(moving), weight[old:].tolist())
        return RunSpec(
            spec=self.spec,
            run_id=run_id,
            workers=(*self.workers, *workers),
            dataplanes=(*self.dataplanes, *dataplanes),
            shift=0,
            table=tuple(table.tolist()),
            lineage=(*self.lineage, self.run_id),
            moved=self.moved | frozenset(outputs[moving].tolist()),
            resend_all=resend_all,
        )

    def remaking(self, outputs: frozenset[int], run_id: RunId) -> RunSpec:
        """The run that continues this one to assemble ``outputs`` again, each on the worker
        after its own (in ``workers``, wrapping): their results were lost after their pieces
        were consumed, so every input sends their pieces again. Every other output stays
        where it is.

        >>> from rechunk_p2p.planning import make_partials
        >>> (p,) = make_partials(((4,), (6,)), ((4,), (1,) * 6))
        >>> spec = ShuffleSpec(ShuffleId("s-0"), p, np.dtype("f8"), "memory", "out")
        >>> run = RunSpec(spec, RunId(1), ("a", "b", "c"), ("A", "B", "C"), shift=0)
        >>> again = run.remaking(frozenset({1, 5}), RunId(2))
        >>> [again.worker_for(i) for i in range(6)], sorted(again.moved), again.lineage
        (['a', 'b', 'b', 'b', 'c', 'a'], [1, 5], (1,))
        >>> sorted(again.reassigned(run))
        [1, 5]
        """
        flats = np.asarray(sorted(outputs), dtype=np.int64)
        table = self.worker_positions(self.spec.outputs_array)
        ranks = np.searchsorted(self.spec.outputs_array, flats)
        table[ranks] = (table[ranks] + 1) % len(self.workers)
        return replace(
            self,
            run_id=run_id,
            shift=0,
            table=tuple(table.tolist()),
            lineage=(*self.lineage, self.run_id),
            moved=self.moved | outputs,
            resend_all=frozenset(),
        )

    def reassigned(self, before: RunSpec) -> frozenset[int]:
        """The moved outputs this run assembles on another worker than ``before`` did (a run
        of its lineage)."""
        moved = self._moved
        if not len(moved):
            return frozenset()
        now = np.asarray(self.workers)[self.worker_positions(moved)]
        then = np.asarray(before.workers)[before.worker_positions(moved)]
        return frozenset(moved[now != then].tolist())
