"""The task graph of a P2P rechunk, built from a plan, as a cullable graph layer.

Where it runs: the client, when the user calls :func:`rechunk_p2p.rechunk` or computes the
result (pure graph construction; nothing is submitted).

Per sub-shuffle (partial) that needs one: a transfer task per input chunk
(``rechunk_p2p-transfer-<token>``), one barrier (``rechunk_p2p-barrier-<token>-<partial>``)
and an unpack task per output chunk (``rechunk-p2p-out-<token>``, the output array's own keys).
Partials that need no shuffle (one input chunk, one output chunk, or no elements) get one plain
task per output chunk under the same output name.

Culling (computing part of the output) keeps, per partial, only the outputs asked for and the
inputs that hold a piece of one of them: the culled sub-shuffle is a smaller shuffle with an
id of its own, or plain tasks when one output chunk is left.

When the plan joins input chunks (``RechunkPlan.groups``), the tasks that make them are taken
from the input's graph (:mod:`rechunk_p2p.sources`) and run inside the transfer task of their
group, which joins them before cutting; a partial without a shuffle reads each group from a
task of its own (``rechunk_p2p-joined-<token>``). The input's own chunk tasks are then no
dependency of the rechunk: only the few shared values they read are.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Collection, Iterator, Mapping
from dataclasses import replace
from typing import Any

import dask.array as da
import numpy as np
from dask._task_spec import GraphNode, Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, Layer
from dask.typing import Key
from dask.utils import key_split

from rechunk_p2p import scheduler_tuning, tasks
from rechunk_p2p.config import Storage
from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.holders import HeldChunks, group_holders, partial_transfers
from rechunk_p2p.planning import Partial, RechunkPlan
from rechunk_p2p.planning.groups import group_members
from rechunk_p2p.sources import ChainedTasks, InputSources, read_together
from rechunk_p2p.spec import (
    HELD_PREFIX,
    JOINED_PREFIX,
    OUTPUT_PREFIX,
    TRANSFER_PREFIX,
    ShuffleId,
    ShuffleSpec,
    barrier_key,
    transfer_name,
    widen,
)


class BarrierTask(Task):
    """**Immutable.** The barrier of one sub-shuffle; carries its spec to the scheduler.

    The spec is also passed to ``func`` as ``spec=`` (the barrier needs it when the graph is
    computed without distributed workers). Fusion with neighbouring tasks is blocked: the
    scheduler finds the barrier by its key.
    """

    __slots__ = ()  # the spec lives in ``kwargs`` only: a copy (``substitute``) passes it on

    def __init__(self, key: Any, func: Any, /, *args: Any, spec: ShuffleSpec, **kwargs: Any):
        super().__init__(key, func, *args, spec=spec, **kwargs)

    @property
    def spec(self) -> ShuffleSpec:
        return self.kwargs["spec"]

    @property
    def block_fusion(self) -> bool:
        return True


class UnpackTask(Task):
    """**Immutable.** The task that assembles one output chunk of a sub-shuffle.

    Fusion with neighbouring tasks is blocked: the scheduler pins the task to the worker that
    holds its pieces by its key, which fusion (e.g. with a downstream ``getitem``) would rename.
    """

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True


class RechunkLayer(Layer):
    """**Immutable** (its graph is built once, on first use). The tasks of one P2P rechunk.

    Parameters
    ----------
    name
        The output array's name.
    input_name
        The input array's name.
    plan
        The rechunk's plan.
    token
        Identifies the rechunk (input, chunks and settings).
    storage
        The ``rechunk-p2p.storage`` setting in force when the graph was built.
    unknown_axes
        Axes of unknown chunk sizes (see :func:`rechunk_p2p.spec.widen`).
    keep
        Global indices of the output chunks to build; ``None``: all of them.
    sources
        The tasks that make the input's chunks; required when the plan joins input chunks
        (``plan.groups``), and only used then.
    held
        Where the chunks of a held input sit (:func:`rechunk_p2p.holders.find_held`): one
        transfer task then cuts several chunks of one worker, up to ``group_bytes``.
    """

    def __init__(
        self,
        name: str,
        input_name: str,
        plan: RechunkPlan,
        token: str,
        storage: Storage,
        unknown_axes: tuple[int, ...] = (),
        keep: frozenset[tuple[int, ...]] | None = None,
        annotations: Mapping[str, Any] | None = None,
        sources: InputSources | None = None,
        held: HeldChunks | None = None,
        group_bytes: int = 0,
    ) -> None:
        super().__init__(annotations=annotations)
        scheduler_tuning.materializing()  # in a scheduler's process: before its submission
        if plan.groups is not None and sources is None and held is None:
            raise RechunkInputError(
                f"Rechunk {token}: a plan that joins input chunks needs the tasks that make "
                "them or where they are held"
            )
        self.name = name
        self.input_name = input_name
        self.plan = plan
        self.token = token
        self.storage = storage
        self.unknown_axes = unknown_axes
        self.keep = keep
        self.sources = sources if plan.groups is not None else None
        self.held = held if self.sources is None and not unknown_axes else None
        if self.held is not None and plan.groups is not None:
            self._groups_held: HeldChunks | None = self.held.joined(plan.groups)
        else:
            self._groups_held = self.held
        self.group_bytes = group_bytes
        self._members: list[tuple[range, ...]] | None = None  # per axis, of each group
        self._graph: dict[Any, Any] | None = None

    def __repr__(self) -> str:
        kept = "all" if self.keep is None else len(self.keep)
        return f"RechunkLayer<{self.name}, outputs: {kept}>"

    # --- Layer ----------------------------------------------------------------------------

    def is_materialized(self) -> bool:
        return self._graph is not None

    def get_output_keys(self) -> set[Any]:
        indices = self.keep if self.keep is not None else self.get_output_indices()
        return {(self.name, *index) for index in indices}

    def __getitem__(self, key: Any) -> Any:
        return self._dict[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def cull(
        self, keys: set[Any], all_hlg_keys: Collection[Any]
    ) -> tuple[RechunkLayer, dict[Any, set[Any]]]:
        """The layer that builds only the output chunks among ``keys``, and its dependencies."""
        wanted = frozenset(
            tuple(k[1:]) for k in keys if isinstance(k, tuple) and k and k[0] == self.name
        )
        if self.keep is not None:
            wanted &= self.keep
        layer = self
        if wanted != (self.keep if self.keep is not None else self.get_output_indices()):
            layer = RechunkLayer(
                self.name,
                self.input_name,
                self.plan,
                self.token,
                self.storage,
                self.unknown_axes,
                wanted,
                self.annotations,
                self.sources,
                self.held,
                self.group_bytes,
            )
        deps = {key: set(task.dependencies) for key, task in layer._dict.items()}
        return layer, deps

    def get_output_indices(self) -> frozenset[tuple[int, ...]]:
        grid = tuple(len(c) for c in self.plan.new_chunks)
        return frozenset(tuple(map(int, i)) for i in np.ndindex(grid))

    # --- construction ---------------------------------------------------------------------

    @property
    def _dict(self) -> dict[Any, Any]:
        if self._graph is None:
            self._graph = self._construct()
        return self._graph

    def _construct(self) -> dict[Any, Any]:
        scheduler_tuning.materializing()  # on a scheduler: before the allocations below
        dsk: dict[Any, Any] = {}
        kept = self._kept_by_partial()
        for partial in self.plan.partials:
            keep = None if kept is None else frozenset(kept.get(partial.index, ()))
            if keep is not None and not keep:
                continue
            # culled to one output chunk, a partial is a plain concatenation of its inputs
            if partial.needs_shuffle and (keep is None or len(keep) > 1):
                dsk.update(self._shuffle_tasks(partial, keep))
            else:
                dsk.update(self._direct_tasks(partial, keep))
        return dsk

    def _kept_by_partial(self) -> dict[tuple[int, ...], set[int]] | None:
        """Partial index -> flat indices of its outputs to build (``None``: all), in one pass
        over the kept outputs (each found by bisecting the partials' offsets per axis)."""
        if self.keep is None:
            return None
        partials = {p.index: p for p in self.plan.partials}
        ndim = len(self.plan.new_chunks)
        starts = [sorted({p.new_offset[a] for p in partials.values()}) for a in range(ndim)]
        kept: dict[tuple[int, ...], set[int]] = {}
        for index in self.keep:
            group = tuple(bisect.bisect_right(starts[a], i) - 1 for a, i in enumerate(index))
            kept.setdefault(group, set()).add(partials[group].flat_output(index))
        return kept

    def _shuffle_tasks(self, partial: Partial, keep: frozenset[int] | None) -> dict[Any, Any]:
        shuffle_id = f"{self.token}-{'.'.join(map(str, partial.index))}"
        transfers_name = transfer_name(self.input_name, self.token)
        if keep is not None and len(keep) < partial.n_outputs:
            # a culled sub-shuffle is another shuffle: its own id and transfer keys
            digest = hashlib.sha1(repr(sorted(keep)).encode(), usedforsecurity=False)
            suffix = "-" + digest.hexdigest()[:12]
            shuffle_id += suffix
            transfers_name += suffix
        else:
            keep = None
        spec = ShuffleSpec(
            shuffle_id=ShuffleId(shuffle_id),
            partial=partial,
            dtype=self.plan.dtype,
            storage=self.storage,
            output_name=self.name,
            keep=keep,
            unknown_axes=self.unknown_axes,
            send_buffer_bytes=self.plan.send_buffer_bytes,
            label=key_split(self.input_name),
        )
        groups = self._held_groups(spec)
        if groups is not None:
            spec = replace(spec, transfer_groups=groups)
            return self._grouped_tasks(spec, transfers_name)
        dsk: dict[Any, Any] = {}
        transfers = []
        for flat in spec.inputs:
            index = partial.input_index(flat)
            key: Key = (transfers_name, *index)
            if self.plan.groups is None:
                source: TaskRef | GraphNode = TaskRef((self.input_name, *index))
            else:
                source = self._joined(index)  # made inside the transfer
            producer = isinstance(source, GraphNode) and source.data_producer
            dsk[key] = Task(key, tasks.transfer, source, shuffle_id, flat, _data_producer=producer)
            transfers.append(TaskRef(key))
        return self._barrier_and_outputs(dsk, spec, transfers)

    def _barrier_and_outputs(
        self, dsk: dict[Any, Any], spec: ShuffleSpec, transfers: list[TaskRef]
    ) -> dict[Any, Any]:
        """``dsk`` with the barrier of ``spec`` over ``transfers`` and its unpack tasks."""
        bkey = barrier_key(spec.shuffle_id)
        dsk[bkey] = BarrierTask(bkey, tasks.barrier, spec.shuffle_id, *transfers, spec=spec)
        for flat in spec.outputs:
            key = spec.output_key(flat)
            dsk[key] = UnpackTask(key, tasks.unpack, spec.shuffle_id, flat, TaskRef(bkey), key)
        return dsk

    def _held_groups(self, spec: ShuffleSpec) -> tuple[tuple[int, ...], ...] | None:
        """The held inputs of ``spec`` that share a transfer task, if any do (always, where
        the plan joins held chunks)."""
        held = self._groups_held
        if held is None or self.group_bytes <= 0:
            return None
        chunk = self.plan.largest_cut_bytes
        groups = partial_transfers(spec.partial, spec.inputs, held, self.group_bytes, chunk)
        return groups if self.plan.groups is not None or len(groups) < len(spec.inputs) else None

    def _grouped_tasks(self, spec: ShuffleSpec, name: str) -> dict[Any, Any]:
        """One transfer task per group of held inputs (``spec.transfer_groups``)."""
        assert spec.transfer_groups is not None
        # (named after the groups: a graph built when the chunks sat elsewhere differs)
        digest = hashlib.sha1(repr(spec.transfer_groups).encode(), usedforsecurity=False)
        name = f"{name}-{digest.hexdigest()[:12]}"
        held_name = HELD_PREFIX + name.rpartition(TRANSFER_PREFIX)[2]
        dsk: dict[Any, Any] = {}
        transfers = []
        # every chunk a group reads gets a second dependent, one held task per worker that
        # reads all of that worker's groups' chunks and runs before them (see tasks.held);
        # a group of chunks whose place is unknown has one of its own
        assert self._groups_held is not None
        holders = group_holders(spec.partial, spec.transfer_groups, self._groups_held)
        held_keys = {h: (held_name, k) for k, h in enumerate(dict.fromkeys(holders))}
        reads: dict[Any, set] = {h: set() for h in held_keys}
        for g, (flats, holder) in enumerate(zip(spec.transfer_groups, holders)):
            key, held = (name, g), held_keys[holder]
            refs = [self._held_chunk(spec.partial.input_index(f)) for f in flats]
            task = Task(
                key, tasks.transfer_group, spec.shuffle_id, flats, *refs, after=TaskRef(held)
            )
            dsk[key] = task
            reads[holder] |= task.dependencies - {held}
            transfers.append(TaskRef(key))
        for holder, held in held_keys.items():
            read = sorted(reads[holder], key=str)
            dsk[held] = Task(held, tasks.held, *(TaskRef(d) for d in read))
        return self._barrier_and_outputs(dsk, spec, transfers)

    def _held_chunk(self, index: tuple[int, ...]) -> GraphNode | TaskRef:
        """Held input chunk ``index``: a reference to it, or (derived from a held chunk)
        the task that computes it, to run inside the transfer; where the plan joins chunks,
        the node that joins the chunks of group ``index``."""
        assert self.held is not None
        if self.plan.groups is not None:
            return self._joined(index)
        return self._chunk_node(index)

    def _box(self, chunks: list[tuple[int, ...]], grid: tuple[int, ...]) -> Task | None:
        """The task that makes input ``chunks`` as one box through a chain of elementwise
        steps (:meth:`ChainedTasks.box_task`), where the input is made that way."""
        layer = self.sources.layer if self.sources is not None else None
        if not isinstance(layer, ChainedTasks):
            return None
        return layer.box_task([(self.input_name, *c) for c in chunks], grid, tasks.join)

    def _chunk_node(self, index: tuple[int, ...]) -> GraphNode | TaskRef:
        """The node that gives input chunk ``index``: the task that makes it, the task that
        computes it from a held chunk, or a reference to the held chunk."""
        if self.sources is not None:
            return self.sources.task((self.input_name, *index))
        assert self.held is not None
        if self.held.tasks is not None:
            return self.held.tasks[index]
        return TaskRef((self.input_name, *index))

    def _direct_tasks(self, partial: Partial, keep: frozenset[int] | None) -> dict[Any, Any]:
        dsk: dict[Any, Any] = {}
        dtype = self.plan.dtype
        for flat in sorted(keep) if keep is not None else range(partial.n_outputs):
            key = (self.name, *partial.output_index(flat))
            shape = partial.output_shape(flat)
            pieces = list(partial.inputs_of_output(flat))
            if not pieces or 0 in shape:
                dsk[key] = Task(key, tasks.empty, shape, dtype)
                continue
            placements = tuple(
                (widen(in_sl, self.unknown_axes), widen(out_sl, self.unknown_axes))
                for _, in_sl, out_sl in pieces
            )
            refs = [self._input_ref(glob, dsk) for glob, _, _ in pieces]
            dsk[key] = Task(
                key, tasks.assemble, shape, dtype, placements, *refs, unknown=self.unknown_axes
            )
        return dsk

    def _input_ref(self, index: tuple[int, ...], dsk: dict[Any, Any]) -> TaskRef:
        """A reference to input ``index`` for a plain task: the input's own chunk, or a task
        (added to ``dsk``) that makes and joins the chunks of group ``index``."""
        if self.plan.groups is None:
            return TaskRef((self.input_name, *index))
        key: Key = (JOINED_PREFIX + self.token, *index)
        if key not in dsk:
            dsk[key] = self._made(index, tasks.join, key)
        return TaskRef(key)

    def _joined(self, index: tuple[int, ...]) -> GraphNode | TaskRef:
        """A node, to run inside a transfer task, that makes the input chunks of group
        ``index`` and hands them to the cut as one block (unjoined: the cut places each)."""
        return self._made(index, tasks.made)

    def _made(self, index: tuple[int, ...], func: Any, key: Any = None) -> GraphNode | TaskRef:
        """The task ``key`` that makes (or reads, held) the input chunks of group ``index``
        and calls ``func`` with the grid and the chunks in C order; a group of one chunk
        without a ``key`` is that chunk's own node."""
        assert self.plan.groups is not None
        if self._members is None:
            self._members = [group_members(g) for g in self.plan.groups]
        members = [axis[i] for axis, i in zip(self._members, index)]
        chunks = list(itertools.product(*members))
        grid = tuple(len(m) for m in members)
        boxed = self._box(chunks, grid) if len(chunks) > 1 else None
        made: list[GraphNode | TaskRef]
        if boxed is not None:  # the inputs made and joined, an elementwise step applied once
            made, grid = [boxed], (1,) * len(grid)
        elif (
            self.sources is not None
            and len(chunks) > 1
            and (read := self.sources.box_read(chunks, grid))
        ):  # one read of the whole group (any elementwise steps applied once), known
            made, grid = [read], (1,) * len(grid)  # without making each chunk's task
        else:
            made = [self._chunk_node(chunk) for chunk in chunks]
            if len(made) == 1 and key is None:
                return made[0]
            together = read_together(made, grid) if self.sources is not None else None
            if together is not None:  # one read of the whole group, any elementwise steps
                made, grid = [together], (1,) * len(grid)  # applied once
        producer = any(isinstance(t, GraphNode) and t.data_producer for t in made)
        return Task(key, func, grid, *made, _data_producer=producer)


def build_rechunk(
    x: da.Array,
    plan: RechunkPlan,
    token: str,
    storage: Storage,
    new_chunks: tuple[tuple[float, ...], ...] | None = None,
    unknown_axes: tuple[int, ...] = (),
    sources: InputSources | None = None,
    held: HeldChunks | None = None,
    group_bytes: int = 0,
) -> da.Array:
    """The dask array that is ``x`` rechunked to ``plan.new_chunks`` through P2P shuffles.

    ``new_chunks`` are the output's chunks when they differ from the plan's (unknown sizes
    along ``unknown_axes``, which the plan counts as one element per chunk). ``sources``: the
    tasks that make ``x``'s chunks, required when the plan joins them; the graph then holds
    those tasks inside its own and depends only on the values they share, not on ``x``.
    ``held``: where a held input's chunks sit; a transfer task then cuts several chunks of
    one worker, up to ``group_bytes``.
    """
    name = OUTPUT_PREFIX + token
    layer = RechunkLayer(
        name,
        x.name,
        plan,
        token,
        storage,
        unknown_axes,
        sources=sources,
        held=held,
        group_bytes=group_bytes,
    )
    if layer.sources is not None:
        shared = dict(layer.sources.shared)
        graph = HighLevelGraph(
            {**shared, name: layer}, {**{k: set() for k in shared}, name: set(shared)}
        )
        return da.Array(graph, name, new_chunks or plan.new_chunks, meta=x._meta)
    # An array without elements gets empty chunks that read no input: then x is no dependency.
    reads_x = plan.nbytes > 0
    dependencies: list[Any] = [x] if reads_x else []  # (dask types them as its protocol)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=dependencies)
    return da.Array(graph, name, new_chunks or plan.new_chunks, meta=x._meta)
