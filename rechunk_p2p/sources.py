"""Input chunks that transfer tasks can make themselves.

Where it runs: the client, while a rechunk's graph is built (pure graph inspection; nothing is
computed or submitted).

dask fuses the task that makes an input chunk into its transfer task when nothing else reads
the chunk, so a chunk made from nothing (generated data) or from a few shared values (the array
object of a zarr store) is made where it is cut and never travels. The engine can then go one
step further: a transfer task may make several neighbouring chunks and cut them together (see
:mod:`rechunk_p2p.planning.groups`). :func:`find_sources` says whether an array's chunks are
made that way and hands over the tasks that make them.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import dask.array as da
import numpy as np
from dask._task_spec import DataNode, GraphNode, Task, TaskRef, _execute_subgraph
from dask.array import chunk
from dask.array.core import getter
from dask.blockwise import Blockwise, blockwise_token, optimize_blockwise
from dask.highlevelgraph import HighLevelGraph, Layer, MaterializedLayer
from dask.typing import Key

from rechunk_p2p.errors import RechunkTypeError
from rechunk_p2p.zarr_reads import read_box_blocking

#: At most this many shared values (keys outside the chunks' own tasks) may feed the chunks.
MAX_SHARED_KEYS = 8


@dataclass(frozen=True)
class InputSources:
    """**Immutable.** How an array's chunks are made, for transfer tasks to make them.

    ``layer`` maps each chunk key of the array to the task that makes it (dask's blockwise
    fusion already applied; materialised on first use; for a chain of chunk-wise steps on
    top of such chunks, :class:`ChainedTasks`). ``shared`` are the graph layers of the
    values those tasks read: each has a few keys and no dependencies of its own.
    """

    layer: Mapping[Any, Any]
    shared: Mapping[str, Layer]

    def task(self, key: Any) -> Task:
        """The task that makes chunk ``key`` (a :class:`~dask._task_spec.Task`)."""
        node = self.layer[key]
        if not isinstance(node, Task):  # checked for materialised layers by find_sources
            raise RechunkTypeError(
                f"Input chunk {key!r} is not made by a task but given as {type(node).__name__}"
            )
        return node

    def box_read(self, chunks: list[tuple[int, ...]], grid: tuple[int, ...]) -> Task | None:
        """One task that reads the box of input ``chunks`` (block indices, in C order over
        ``grid``, a box of consecutive blocks) in one call, known from the layer's structure
        without making a task a chunk: where the layer is blockwise over dask's slices of
        an array object (``da.from_array``, ``da.from_zarr``, then any elementwise chain
        :func:`read_together` takes) and nothing else varies from chunk to chunk, only the
        first chunk's task is made and its slices widened to the box's. Else ``None``
        (:func:`read_together` then looks at each chunk's task). At ERA5's 96,432 hourly
        chunks making every chunk's task to compare them took the scheduler 4-8 s."""
        layer = self.layer
        if not isinstance(layer, Blockwise) or layer.concatenate or layer.new_axes:
            return None
        slices = _slice_dep(layer)
        if slices is None:
            return None
        first, last = chunks[0], chunks[-1]
        if any(b - a + 1 != n for a, b, n in zip(first, last, grid)):
            return None
        key: Key = (layer.output, *first)
        culled, _ = layer.cull({key}, [])
        task = dict(culled).get(key)
        if not isinstance(task, Task):
            return None
        start, stop = slices[first], slices[last]
        box = tuple(slice(a.start, b.stop) for a, b in zip(start, stop))
        return _widened(task, start, box)


def _varying(layer: Blockwise) -> list[tuple[str, tuple[Any, ...]]]:
    """The inputs of ``layer`` that vary with the block, and their indices (dask types an
    input's name as a key or a reference; one that varies is an array's name)."""
    return [(cast(str, name), tuple(index)) for name, index in layer.indices if index is not None]


def _all_keys(name: str, blocks: Sequence[int]) -> list[tuple[Any, ...]]:
    """Every key of array ``name`` with ``blocks`` blocks along each axis."""
    return [(name, *i) for i in itertools.product(*(range(n) for n in blocks))]


def _slice_dep(layer: Blockwise) -> Any:
    """The one input of ``layer`` that varies with the block: dask's slices of an array
    object, indexed like the output; ``None`` where another input varies too."""
    from dask.layers import ArraySliceDep

    varying = _varying(layer)
    if len(varying) != 1:
        return None
    name, index = varying[0]
    dep = layer.io_deps.get(name)
    if not isinstance(dep, ArraySliceDep) or tuple(index) != tuple(layer.output_indices):
        return None
    return dep


def _widened(task: Task, start: tuple[slice, ...], box: tuple[slice, ...]) -> Task | None:
    """``task`` (a read of the slices ``start``, possibly through an elementwise chain) as
    one read of ``box``, or ``None`` where its form is not one :func:`read_together`
    knows."""
    if task.func is getter and len(task.args) == 2:
        source, at = task.args
        if isinstance(source, TaskRef) and isinstance(at, DataNode) and at.value == start:
            return Task(None, read_box_blocking, source, DataNode(None, box), **task.kwargs)
        return None
    at = elementwise_read(task) if task.func is _execute_subgraph else None
    if at is None or not isinstance(task.args[at], DataNode) or task.args[at].value != start:
        return None
    return _chain_together([task], (1,) * len(box), box)


def find_sources(x: da.Array) -> InputSources | None:
    """The tasks that make ``x``'s chunks, when each is made from nothing or from a few shared
    values, possibly through a chain of chunk-wise steps (see :func:`_through_steps`);
    ``None`` when a chunk is held data, a future, made from other chunks, annotated, or made
    by a task that must not be fused (such as another rechunk's output): :func:`not_made`
    says which."""
    found = _find(x)
    return found if isinstance(found, InputSources) else None


def not_made(x: da.Array) -> str | None:
    """Why transfer tasks cannot make ``x``'s chunks themselves (``None``: they can)."""
    found = _find(x)
    return None if isinstance(found, InputSources) else found


def _find(x: da.Array) -> InputSources | str:
    """:func:`find_sources`, or why not."""
    graph = x.__dask_graph__()
    if not isinstance(graph, HighLevelGraph):
        return "its graph has no layers (a plain dict)"
    if any(layer.annotations for layer in graph.layers.values()):
        return "a layer of its graph is annotated (dask.annotate): its tasks stay apart"
    # (blockwise fusion keeps the layers of the keys it is given: one key of x's layer is
    # enough, where listing all of ERA5's 96,432 took 1.3 s)
    fused = optimize_blockwise(graph, keys=[(x.name, *(0,) * x.ndim)])
    # (its keys listed from the block counts: dask's nested lists of them took 1.1 s there)
    return _sources_in(fused, x.name, functools.partial(_all_keys, x.name, x.numblocks))


def _sources_in(fused: HighLevelGraph, name: str, keys: Callable[[], list]) -> InputSources | str:
    """:func:`find_sources` for the chunks ``keys()`` of layer ``name`` of ``fused`` (a
    graph that dask's blockwise fusion went over), or why not."""
    layer = fused.layers.get(name)
    if layer is None:
        return f"its chunks are not a layer of its graph ({name!r})"
    shared = {dep: fused.layers[dep] for dep in fused.dependencies.get(name, ())}
    if not _small_roots(fused, shared):
        if isinstance(layer, Blockwise):
            return _through_steps(fused, layer, shared)
        return f"its chunks ({_what(name)}) are computed from other tasks' results"
    if isinstance(layer, Blockwise):
        return InputSources(layer, shared)
    if isinstance(layer, MaterializedLayer) and _made_by_tasks(layer, keys(), shared):
        return InputSources(layer, shared)
    return f"its chunks ({_what(name)}) are held data, futures or tasks that stay apart"


def _what(name: str) -> str:
    """A layer's name as dask's task names read (``key_split``)."""
    from dask.utils import key_split

    return key_split(name)


def _through_steps(
    fused: HighLevelGraph, layer: Blockwise, deps: Mapping[str, Layer]
) -> InputSources | str:
    """Chunks made by a chunk-wise step (``astype``, arithmetic with scalars, ``where``,
    ``map_blocks``, ...) from the chunks at the same index of arrays whose chunks are made
    themselves (generated data that dask's blockwise fusion cannot take in, being no
    blockwise layer of its own), and from a few shared values: each chunk's task with the
    tasks that make the chunks it reads put in place of its references to them. Or why
    not."""
    step = _what(layer.output)
    if layer.concatenate or layer.new_axes:
        return f"step {step!r} joins chunks or adds axes"
    varying = _varying(layer)
    own = tuple(layer.output_indices)
    aligned = {dep for dep, index in varying if dep in deps and index == own}
    if not aligned or any(dep in aligned and index != own for dep, index in varying):
        return f"step {step!r} reads chunks at other places than its own (a transpose, overlap)"
    inner = {}
    for dep in aligned:
        blocks = layer.numblocks[dep]
        made = _sources_in(fused, dep, functools.partial(_all_keys, dep, blocks))
        if isinstance(made, str):
            return made
        inner[dep] = made
    shared = {dep: deps[dep] for dep in deps if dep not in aligned}
    for made in inner.values():
        shared.update(made.shared)
    if not _small_roots(fused, shared):
        others = ", ".join(sorted({_what(d) for d in shared})) or "none"
        return f"step {step!r} reads the results of other computations ({others})"
    return InputSources(ChainedTasks(layer, inner), shared)


class ChainedTasks(Mapping[Any, Any]):
    """**Immutable.** The task of each chunk of a chunk-wise step, with the tasks that make
    the chunks it reads in place of its references to them: one task makes the chunk, its
    inputs and the step together, where it is cut.

    Parameters
    ----------
    step
        The step's layer (after dask's blockwise fusion).
    inputs
        How the chunks the step reads are made, by the name of their layer.
    """

    def __init__(self, step: Blockwise, inputs: Mapping[str, InputSources]) -> None:
        self._step = step
        self._inputs = dict(inputs)
        self._template = _box_template(step, set(inputs))

    def box_task(
        self, keys: list[tuple[Any, ...]], grid: tuple[int, ...], join: Callable[..., Any]
    ) -> Task | None:
        """One task that makes the box of chunks ``keys`` (the step's keys, in C order over
        ``grid``): the chunks of each input made and joined by ``join(grid, *chunks)``, and
        the step applied once to the joined box, where the step is elementwise with scalars
        besides its inputs; else ``None``. Nothing of the step's layer is materialised: a
        chain over 17,520 made chunks cost 2.4 s of the client's time to build chunk by
        chunk."""
        if self._template is None:
            return None
        template, tokens = self._template
        subs: dict[Key, Key | GraphNode] = {
            token: Task(None, join, grid, *(self._inputs[name].task((name, *k[1:])) for k in keys))
            for token, name in tokens.items()
        }
        task = template.substitute(subs)
        return Task(None, task.func, *task.args, **task.kwargs)

    def __getitem__(self, key: Any) -> Any:
        node = self._step[key]
        subs = {
            dep: self._inputs[dep[0]].task(dep)
            for dep in getattr(node, "dependencies", ())
            if isinstance(dep, tuple) and dep[0] in self._inputs
        }
        return node.substitute(subs) if subs else node

    def __iter__(self) -> Iterator[Any]:
        return iter(self._step)

    def __len__(self) -> int:
        return len(self._step)


def _box_template(step: Blockwise, inputs: set[str]) -> tuple[Task, dict[str, str]] | None:
    """The step's task with its scalar arguments in place, and the tokens that stand for its
    chunk inputs (by input name), where every step is elementwise (:data:`ELEMENTWISE`,
    numpy ufuncs) and every argument but the inputs a scalar; else ``None``."""
    task = getattr(step, "task", None)
    if not isinstance(task, Task):
        return None
    subs: dict[Key, Key | GraphNode] = {}
    tokens: dict[str, str] = {}
    for i, (arg, index) in enumerate(step.indices):
        token = blockwise_token(i)
        if index is not None:
            if arg not in inputs:
                return None
            tokens[token] = cast(str, arg)  # (an input that varies: an array's name)
        elif isinstance(arg, (GraphNode, TaskRef)) or np.ndim(arg) != 0:
            return None
        else:
            subs[token] = DataNode(None, arg)
    if task.func is _execute_subgraph:
        subgraph, _, inkeys, *args = task.args
        if not (
            isinstance(subgraph, dict)
            and all(isinstance(a, TaskRef) and a.key in subs.keys() | tokens.keys() for a in args)
            and _elementwise(subgraph, None, set(inkeys))
        ):
            return None
    elif not _elementwise({task.key: task}, None, subs.keys() | tokens.keys()):
        return None
    return task.substitute(subs), tokens


def _small_roots(graph: HighLevelGraph, layers: Mapping[str, Layer]) -> bool:
    """Whether ``layers`` are a few values that depend on nothing (counted only for layers
    that are already materialised, so that no other layer is built here)."""
    if any(graph.dependencies.get(name) for name in layers):
        return False
    if not all(isinstance(layer, MaterializedLayer) for layer in layers.values()):
        return False
    return sum(len(layer) for layer in layers.values()) <= MAX_SHARED_KEYS


def _made_by_tasks(layer: Layer, keys: list, shared: Mapping[str, Layer]) -> bool:
    """Whether each of ``keys`` is a fusable task of ``layer`` reading only ``shared`` keys."""
    allowed = {key for shared_layer in shared.values() for key in shared_layer}
    for key in keys:
        node = layer.get(key)
        if not isinstance(node, Task) or node.block_fusion:
            return False
        if not node.dependencies <= allowed:
            return False
    return True


def read_together(made: list[Any], grid: tuple[int, ...]) -> Task | None:
    """One task that reads the box of chunks ``made`` (their tasks, in C order over
    ``grid``) in one call, when each is ``dask.array.core.getter`` of one array object (what
    ``da.from_array`` and ``da.from_zarr`` make) at slices that tile that box, possibly
    followed by a chain of elementwise steps with scalars (:func:`elementwise_read`): the
    chain is then applied once, to the box; else ``None``.

    A zarr array read once for eight chunks decodes them in one request (its codec pipeline
    reads the chunks of a request together) and hands over one block, where eight reads
    each pay a request and make a block to join. The read goes through
    :func:`~rechunk_p2p.zarr_reads.read_box_blocking` (zarrs' pipeline where it can).
    """
    first = made[0]
    if not isinstance(first, Task):
        return None
    if first.func is _execute_subgraph:
        return _chain_together(made, grid)
    if first.func is not getter or len(first.args) != 2:
        return None
    source = first.args[0]
    if not isinstance(source, TaskRef):
        return None
    boxes = []
    for task in made:
        if (
            not isinstance(task, Task)
            or task.func is not getter
            or len(task.args) != 2
            or task.kwargs != first.kwargs
            or not isinstance(task.args[0], TaskRef)
            or task.args[0].key != source.key
            or not isinstance(task.args[1], DataNode)
        ):
            return None
        boxes.append(task.args[1].value)
    union = _union(boxes, grid)
    if union is None:
        return None
    return Task(None, read_box_blocking, source, DataNode(None, union), **first.kwargs)


def _chain_together(
    made: list[Any], grid: tuple[int, ...], box: tuple[slice, ...] | None = None
) -> Task | None:
    """:func:`read_together` of chunks made by one fused elementwise chain over a read
    (reading ``box`` where given, else the union of the chunks' slices)."""
    first = made[0]
    at = elementwise_read(first)
    if at is None:
        return None
    boxes = []
    for task in made:
        if (
            not isinstance(task, Task)
            or task.func is not _execute_subgraph
            or task.args[0] is not first.args[0]  # (one subgraph for the layer's chunks)
            or len(task.args) != len(first.args)
            or any(
                k != at and not _same_node(a, b)
                for k, (a, b) in enumerate(zip(task.args, first.args))
            )
            or not isinstance(task.args[at], DataNode)
        ):
            return None
        boxes.append(task.args[at].value)
    union = _union(boxes, grid) if box is None else box
    if union is None:
        return None
    args = list(first.args)
    args[0] = {  # (the one read through zarrs' pipeline where it can)
        key: Task(key, read_box_blocking, *node.args, **node.kwargs)
        if isinstance(node, Task) and node.func is getter
        else node
        for key, node in args[0].items()
    }
    args[at] = DataNode(None, union)
    return Task(None, _execute_subgraph, *args, **first.kwargs)


def _union(boxes: list[Any], grid: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The box that ``boxes`` (slices of each chunk, in C order over ``grid``) tile, or
    ``None`` where they do not."""
    for box in boxes:
        if not isinstance(box, tuple) or not all(
            isinstance(b, slice) and b.step in (None, 1) and b.start is not None for b in box
        ):
            return None
    if len(boxes[0]) != len(grid):
        return None
    # each axis's slices, from the chunks at the start of the others; every chunk's box must
    # be the product of them, and each axis's slices must follow one another
    alongs = [
        [boxes[i * math.prod(grid[axis + 1 :])][axis] for i in range(n)]
        for axis, n in enumerate(grid)
    ]
    if any(a.stop != b.start for along in alongs for a, b in itertools.pairwise(along)):
        return None
    for box, index in zip(boxes, itertools.product(*(range(n) for n in grid))):
        if any(box[a] != alongs[a][i] for a, i in enumerate(index)):
            return None
    return tuple(slice(along[0].start, along[-1].stop) for along in alongs)


#: Functions that compute each element of their result from the same element of their
#: array arguments (and scalars): a chain of them gives the same values on a box as on each
#: of its chunks
ELEMENTWISE: frozenset[Any] = frozenset(
    {
        *(
            getattr(operator, name)
            for name in (
                "add",
                "sub",
                "mul",
                "truediv",
                "floordiv",
                "mod",
                "pow",
                "neg",
                "pos",
                "abs",
                "and_",
                "or_",
                "xor",
                "invert",
                "not_",
                "eq",
                "ne",
                "lt",
                "le",
                "gt",
                "ge",
            )
        ),
        np.where,
        np.clip,
        chunk.astype,
    }
)


def elementwise_read(task: Task) -> int | None:
    """Where the slices of the read are among ``task``'s arguments, when ``task`` (a fused
    chunk task, ``_execute_subgraph``) is one ``getter`` of an array object followed by
    steps that are elementwise (:data:`ELEMENTWISE`, numpy ufuncs) with scalar arguments;
    else ``None``."""
    if task.func is not _execute_subgraph or len(task.args) < 3:
        return None
    subgraph, _, inkeys, *args = task.args
    if not isinstance(subgraph, dict) or len(inkeys) != len(args):
        return None
    values = dict(zip(inkeys, args))
    reads = [n for n in subgraph.values() if isinstance(n, Task) and n.func is getter]
    if len(reads) != 1 or len(reads[0].args) != 2:
        return None
    source, box = reads[0].args
    if not (isinstance(box, TaskRef) and box.key in values and isinstance(source, TaskRef)):
        return None
    scalars = {k for k, v in values.items() if isinstance(v, DataNode) and np.ndim(v.value) == 0}
    if not _elementwise(subgraph, reads[0], scalars):
        return None
    return 3 + list(inkeys).index(box.key)


def _elementwise(subgraph: dict, read: Task | None, allowed: set[Any]) -> bool:
    """Whether every task of ``subgraph`` but ``read`` is elementwise, reads only tasks of
    the subgraph and ``allowed`` keys, and passes only plain keywords."""
    inner = set(subgraph)
    for node in subgraph.values():
        if node is read:
            continue
        if not isinstance(node, Task):
            return False
        func = node.func
        if func is _execute_subgraph:
            sub, _, keys, *args = node.args
            if not all(isinstance(a, TaskRef) and a.key in inner | allowed for a in args):
                return False
            if not isinstance(sub, dict) or not _elementwise(sub, read, set(keys)):
                return False
            continue
        if not (isinstance(func, np.ufunc) or func in ELEMENTWISE):
            return False
        if not all(
            (isinstance(a, TaskRef) and a.key in inner | allowed)
            or (isinstance(a, DataNode) and np.ndim(a.value) == 0)
            for a in node.args
        ):
            return False
        if any(isinstance(v, (np.ndarray, GraphNode)) for v in node.kwargs.values()):
            return False
    return True


def _same_node(a: Any, b: Any) -> bool:
    """Whether two arguments of chunk tasks are the same reference or scalar."""
    if isinstance(a, TaskRef) and isinstance(b, TaskRef):
        return a.key == b.key
    if isinstance(a, DataNode) and isinstance(b, DataNode):
        return np.ndim(a.value) == 0 and np.ndim(b.value) == 0 and bool(a.value == b.value)
    return a is b or (isinstance(a, (str, tuple)) and a == b)
