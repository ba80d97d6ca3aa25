"""Writing a zarr target so that a stopped run is recognisable and can be resumed.

Where it runs: the client (the run record, listing what is done, building the graph) and
task threads (a chunk's write and its completion record).

A target the engine creates holds, until the run has finished, a hidden directory
``.rechunk-p2p/`` beside its metadata: ``run.json``, written before anything else and
removed last, describes the run (source, arrays, chunks, format); ``done/<array>/<chunk>``
is written by the task that wrote that chunk (or shard), after the write returned. A target
with ``run.json`` is an unfinished run of this engine: ``overwrite`` may replace it and
``resume`` continues it, rewriting every chunk without a record (a chunk torn by a kill has
none). zarr ignores the directory (it holds no zarr metadata).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import dask.array as da
import numpy as np
import zarr
from dask._task_spec import Task, TaskRef
from dask.array.core import ArraySliceDep
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from rechunk_p2p.errors import RechunkInputError

RUN_DIRECTORY = ".rechunk-p2p"
RUN_RECORD = f"{RUN_DIRECTORY}/run.json"
DONE = f"{RUN_DIRECTORY}/done"
#: Task-name prefix of the write tasks (how an interrupted run finds them on the workers).
WRITE_PREFIX = "rechunk_p2p-write"
_FORMAT = 1


def root_store(location: Any) -> Store:
    """The zarr store at a target's ``location`` (a local path, or a store as it is)."""
    if isinstance(location, str | os.PathLike):
        return zarr.storage.LocalStore(os.fspath(location))
    return location


def _put(store: Store, key: str, data: bytes) -> None:
    sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def read_run_record(store: Store) -> dict[str, Any] | None:
    """The run record of an unfinished target, ``None`` if it has none (finished, or not
    made by this engine)."""
    data = sync(store.get(RUN_RECORD, prototype=default_buffer_prototype()))
    if data is None:
        return None
    try:
        return json.loads(data.to_bytes())
    except ValueError:
        return {}  # torn while written: an unfinished run that cannot be resumed


def is_unfinished(location: Any) -> bool:
    """Whether a target's ``location`` (a local path, or a store) holds a run record;
    ``False`` where it cannot be read. A local path is looked at directly: opening a local
    store would create its directory."""
    if isinstance(location, str | os.PathLike):
        return os.path.isfile(os.path.join(location, RUN_RECORD))
    try:
        return bool(sync(location.exists(RUN_RECORD)))
    except (OSError, ValueError):
        return False


def write_run_record(store: Store, record: dict[str, Any]) -> None:
    """Mark the target as an unfinished run (before anything else is written)."""
    _put(store, RUN_RECORD, json.dumps({"format": _FORMAT, **record}, sort_keys=True).encode())


def finish_run(store: Store) -> None:
    """Remove the completion records, then the run record (last: the target is whole)."""
    sync(store.delete_dir(DONE))
    sync(store.delete(RUN_RECORD))
    sync(store.delete_dir(RUN_DIRECTORY))  # what a file system keeps of it (a directory)


def run_record_of(source: str, layouts: Sequence[Any], zarr_format: int) -> dict[str, Any]:
    """What identifies a run: the source, every array's shape, dtype and target layout, and
    the target format."""
    return {
        "source": source,
        "zarr_format": zarr_format,
        "arrays": [
            {
                "name": lay.name,
                "shape": list(lay.source.shape),
                "dtype": str(lay.source.dtype),
                "chunks": list(lay.chunks),
                "shards": None if lay.shards is None else list(lay.shards),
            }
            for lay in layouts
        ],
    }


def check_resumable(found: dict[str, Any] | None, wanted: dict[str, Any], where: str) -> None:
    """Refuse to resume into ``where`` unless it holds an unfinished run of ``wanted``.

    Raises
    ------
    RechunkInputError
        No run record, an unreadable one, or one that differs (the message says what).
    """
    if found is None:
        raise RechunkInputError(
            f"nothing to resume at {where}: it holds no unfinished rechunk_p2p run "
            f"({RUN_RECORD} is missing); drop resume=True (--resume) to write a new target"
        )
    if found.get("format") != _FORMAT:
        raise RechunkInputError(
            f"cannot resume at {where}: its run record is unreadable; pass overwrite=True "
            "(--overwrite) to start over"
        )
    for key in ("source", "zarr_format"):
        if found.get(key) != wanted[key]:
            raise RechunkInputError(
                f"cannot resume at {where}: the interrupted run had {key} "
                f"{found.get(key)!r}, this one {wanted[key]!r}"
            )
    before = {a["name"]: a for a in found.get("arrays", [])}
    now = {a["name"]: a for a in wanted["arrays"]}
    if before.keys() != now.keys():
        raise RechunkInputError(
            f"cannot resume at {where}: the interrupted run wrote arrays "
            f"{sorted(before)}, this one {sorted(now)}"
        )
    for name, array in now.items():
        for key, value in array.items():
            if before[name].get(key) != value:
                raise RechunkInputError(
                    f"cannot resume at {where}: array {name or '(array)'!r} had {key} "
                    f"{before[name].get(key)!r} in the interrupted run, {value!r} now"
                )


def done_chunks(store: Store, n_arrays: int) -> list[set[tuple[int, ...]]]:
    """Per array, the chunk (or shard) indices whose write completed."""

    async def keys() -> list[str]:
        return [key async for key in store.list_prefix(DONE + "/")]

    done: list[set[tuple[int, ...]]] = [set() for _ in range(n_arrays)]
    for key in sync(keys()):
        array, _, chunk = key[len(DONE) + 1 :].partition("/")
        index = chunk.split(".")
        if chunk == "_":
            index = []
        elif not all(i.isdigit() for i in index):
            continue  # not a record: a store's temporary file, left by a kill mid-write
        if array.isdigit() and int(array) < n_arrays:
            done[int(array)].add(tuple(int(i) for i in index))
    return done


#: zarr's LocalStore writes a key to ``<key minus suffix>.<uuid4 hex>.partial`` first, then
#: renames it; a kill in between leaves that file.
_TORN = re.compile(r"\.[0-9a-f]{32}\.partial$")


def remove_torn_writes(location: Any) -> int:
    """In a local target, remove the temporary files of writes a kill cut short (zarr never
    reads them; left, they would stay in the finished target). Returns how many."""
    if not isinstance(location, str | os.PathLike):
        return 0  # object stores write a key whole or not at all
    removed = 0
    for folder, _, files in os.walk(os.fspath(location)):
        for name in files:
            if _TORN.search(name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
                    removed += 1
    return removed


@dataclass(frozen=True)
class _Record:
    """**Immutable.** Where a write task records that its chunk is complete."""

    store: Any
    array: int

    def done(self, block_id: tuple[int, ...]) -> None:
        name = ".".join(map(str, block_id)) or "_"
        _put(self.store, f"{DONE}/{self.array}/{name}", b"")


def _write_block(
    block: np.ndarray,
    target: zarr.Array,
    where: tuple[slice, ...],
    record: _Record | None,
    block_id: tuple[int, ...] | None = None,
) -> np.ndarray:
    """Write one chunk (or shard) of the target whole, then record it; a flag, not data."""
    if block.size:
        _unchecked_if_not_empty(target, block)[where] = block
    if record is not None:
        record.done(tuple(block_id or ()))
    return np.ones((1,) * block.ndim, dtype=bool)


def _unchecked_if_not_empty(target: zarr.Array, block: np.ndarray) -> zarr.Array:
    """``target``, or a view of it that writes a chunk without comparing it with the fill
    value first, where ``block`` (one whole chunk) cannot be all fill value: its first
    element differs from it. zarr compares every chunk it writes, element by element, to
    leave chunks of fill value unwritten: 1.4 CPU s for the 1.5 GiB of 12 MiB float32
    chunks a resume wrote (py-spy), against 4.0 s to compress them. Shards are left to zarr
    (it checks their inner chunks one by one), as are blocks that start with the fill
    value."""
    with_config = getattr(target, "with_config", None)  # zarr >= 3.1
    fill = target.fill_value
    if with_config is None or target.shards is not None or block.dtype.kind not in "biufc":
        return target
    first = block.flat[0]
    if fill is not None and (first == fill or (first != first and fill != fill)):
        return target  # NaN == NaN for this purpose, as for zarr; -0.0 == 0.0 is left to it
    return with_config({"write_empty_chunks": True})


def write_arrays(
    arrays: Sequence[da.Array], targets: Sequence[zarr.Array], store: Any | None
) -> list[da.Array]:
    """Per array, a dask array of one flag per chunk whose tasks write ``arrays`` into
    ``targets`` (each chunk of an array is one whole target chunk or shard), recording each
    completed chunk in ``store`` (``None``: no records)."""
    written = []
    for index, (array, target) in enumerate(zip(arrays, targets, strict=True)):
        record = None if store is None else _Record(store, index)
        name = f"{WRITE_PREFIX}-{tokenize(array.name, target, record)}"
        written.append(
            da.map_blocks(
                _write_block,
                array,
                target,
                ArraySliceDep(array.chunks),
                record,
                chunks=tuple((1,) * len(c) for c in array.chunks),
                dtype=bool,
                meta=np.empty((0,) * array.ndim, dtype=bool),
                name=name,
            )
        )
    return written


def missing_keys(
    written: Sequence[da.Array], done: Sequence[set[tuple[int, ...]]]
) -> tuple[HighLevelGraph, list[Any]]:
    """The graph of every write task, and the keys of those whose chunk is not done:
    computing only those culls the graph (only the source chunks that feed them are read and
    rechunked)."""
    keys = [
        (w.name, *index)
        for w, finished in zip(written, done, strict=True)
        for index in np.ndindex(*w.numblocks)
        if index not in finished
    ]
    graph = HighLevelGraph.merge(*(w.__dask_graph__() for w in written))
    return graph, keys


def consolidate(location: Any, fmt: Literal[2, 3]) -> None:
    """Write the target's consolidated metadata (the source had it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
        zarr.consolidate_metadata(location, zarr_format=fmt)


def finished(location: Any, consolidate_as: Literal[2, 3] | None, *flags: Any) -> dict[str, int]:
    """The last task of a lazy run: consolidate the metadata (if ``consolidate_as``, the
    zarr format), then remove the run's records; a count of the chunks written."""
    if consolidate_as is not None:
        consolidate(location, consolidate_as)
    finish_run(root_store(location))
    return {"chunks": int(sum(np.size(f) for f in flags))}


def lazy_run(location: Any, consolidate_as: int | None, written: list[da.Array]) -> Delayed:
    """One ``dask.delayed`` object: computing it writes every chunk, then finishes the
    target (:func:`finished`). Its graph is optimised as an array's once, here (as a
    persist of the arrays would be), so that nothing renames the rechunk's tasks later."""
    graph, keys = missing_keys(written, [set() for _ in written])
    tasks = dict(da.Array.__dask_optimize__(graph, keys))
    key = f"rechunk_p2p-finish-{tokenize(location, keys)}"
    tasks[key] = Task(key, finished, location, consolidate_as, *(TaskRef(k) for k in keys))
    return Delayed(key, tasks)
