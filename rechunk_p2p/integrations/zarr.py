"""Rechunk a zarr array or group into a new zarr store with the P2P engine.

Where it runs: client (the caller's thread), which checks the input
(:mod:`~rechunk_p2p.integrations.zarr_input`), creates the target's metadata and blocks until
the cluster has finished. The tasks it builds run in worker task threads: they read source
chunks, hand them to the engine, and write each target chunk (or shard) exactly once, on
the worker that assembled it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping
from typing import Any

import dask
import dask.array as da
import distributed
from dask.utils import format_bytes, parse_bytes

from rechunk_p2p.arrays import plan_array, rechunk_array
from rechunk_p2p.cluster import cluster_statistics
from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.integrations.local_client import client_for
from rechunk_p2p.integrations.zarr_input import (
    ArrayLayout,
    ZarrRechunkJob,
    check_zarr_rechunk,
    open_source,
    resolve_layouts,
)
from rechunk_p2p.integrations.zarr_report import ZarrRechunkReport, lag_of, lag_probe
from rechunk_p2p.integrations.zarr_run import optimized_writes, run_writes, wait_for_writers
from rechunk_p2p.integrations.zarr_target import (
    create_target,
    describe,
    is_consolidated,
    open_target,
)
from rechunk_p2p.integrations.zarr_writes import (
    check_resumable,
    consolidate,
    done_chunks,
    finish_run,
    is_unfinished,
    lazy_run,
    missing_keys,
    read_run_record,
    remove_torn_writes,
    root_store,
    run_record_of,
    write_arrays,
    write_run_record,
)

__all__ = [
    "ZarrRechunkJob",
    "ZarrRechunkReport",
    "check_zarr_rechunk",
    "open_source",
    "plan_zarr",
    "rechunk_zarr",
    "source_arrays",
]


def rechunk_zarr(
    source: Any,
    target: Any,
    chunks: Any,
    *,
    shards: Any = None,
    zarr_format: int | None = None,
    array_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    resume: bool = False,
    storage: str | None = None,
    progress: bool = True,
    client: distributed.Client | str | None = None,
    coordinates: bool = False,
    compute: bool = True,
    max_mem: int | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ZarrRechunkReport | ZarrRechunk:
    """Copy a zarr array or group to ``target`` with new chunks, rechunking peer to peer.

    Parameters
    ----------
    source : str, os.PathLike, zarr.Array or zarr.Group
        The data to rechunk (zarr format 2 or 3).
    target : str, os.PathLike or zarr store
        Where to write. It must not exist unless ``overwrite=True``.
    chunks
        For an array: anything :meth:`dask.array.Array.rechunk` accepts, and a dict may
        also be keyed by dimension name. For a group: a dict keyed by dimension name
        (``{"time": -1, "lat": 90}``) applied to every array with those dimensions, or by
        array name; arrays that match no key are copied in their own layout. Dimension
        names come from ``dimension_names`` (format 3) or ``_ARRAY_DIMENSIONS`` (format 2).
        The resolved chunks must be regular (all equal but a smaller last one).
    shards : optional
        Shard shape of the rechunked arrays (format 3), given like ``chunks``; each
        entry is a multiple of the chunk size (``-1``: the whole axis). ``None``: not
        sharded.
    zarr_format : {2, 3}, optional
        Format of the target; by default that of the source. Converting between formats
        uses zarr's default codecs for the target format.
    array_options : dict, optional
        Overrides for :func:`zarr.create_array` applied to every target array, from
        ``compressors``, ``filters``, ``serializer``, ``fill_value``, ``order``,
        ``chunk_key_encoding``. By default they are copied from the source.
    overwrite : bool
        Replace an existing zarr store at ``target`` (or an unfinished run there).
    resume : bool
        Continue an unfinished run at ``target`` (one stopped by an interrupt, a lost
        client or cluster): the source, arrays, chunks and format must be the interrupted
        run's; the chunks it completed are kept, the others are written (only the source
        chunks that feed them are read).
    storage : {"disk", "memory", "auto"}, optional
        Where workers keep the pieces they receive (``rechunk-p2p.storage``); by default the config.
    progress : bool
        Show distributed's progress bar on stderr while the cluster works, when stderr is a
        terminal.
    coordinates : bool
        Whether dimension coordinates (1-D arrays named after their dimension, such as
        ``lat``) follow chunks given by dimension name. By default they keep their own
        layout, as xarray keeps index coordinates; an array named in ``chunks`` is always
        rechunked.
    compute : bool
        Run now and return the report (default), or return a :class:`ZarrRechunk` to
        inspect (``.plan``) and run later (``.execute()``), as rechunker's ``rechunk`` does.
    max_mem : int or str, optional
        Memory budget per worker, as rechunker's ``max_mem`` (``"2GB"``): pieces wait in
        memory only if a worker's share of them fits in it (else on local disk), and a
        worker holds at most half of it in pieces queued for sending
        (``rechunk-p2p.comm.run-buffer-bytes``), and a transfer task joins input chunks of at
        most an eighth of it (``rechunk-p2p.transfer-group-bytes``). Default: decide by the
        workers' memory limits (``rechunk-p2p.storage: auto``).
    storage_options : dict, optional
        fsspec options for a source or target given as a URL (``s3://bucket/data.zarr``,
        ``gs://...``): credentials, ``endpoint_url`` via ``client_kwargs`` and so on.
    client : distributed.Client or str, optional
        The cluster to run on: a client, or a scheduler's address (``"tcp://host:8786"``).
        Default: the current client, else a LocalCluster for the call (called from a
        script, that needs the script's ``if __name__ == "__main__":`` guard, which is
        checked first).

    Returns
    -------
    ZarrRechunkReport

    Raises
    ------
    RechunkInputError
        Missing source, existing target, unknown dimension or array names, chunks that
        do not fit an array, bad options, an in-memory target (workers would write to
        copies of it). Raised before any data moves.

    Notes
    -----
    Runs on the cluster of ``client``, else of the current client
    (:func:`distributed.get_client`); with neither, on a :class:`distributed.LocalCluster`
    sized to the machine that lives for the call. Each output chunk of the rechunk is one
    target chunk (or shard), written by one task without locks. Attributes, dimension
    names, fill values, codecs, the group hierarchy and consolidated metadata are kept. If
    a task fails, the target is removed once every write has stopped; a run stopped
    otherwise (Ctrl-C, SIGTERM, a lost cluster or client) leaves the target marked
    unfinished (a ``.rechunk-p2p`` directory in it), for ``resume=True`` or
    ``overwrite=True``.
    """
    job = check_zarr_rechunk(
        source,
        target,
        chunks,
        shards=shards,
        zarr_format=zarr_format,
        array_options=array_options,
        overwrite=overwrite,
        resume=resume,
        storage=storage,
        coordinates=coordinates,
        storage_options=storage_options,
    )
    if max_mem is not None:
        max_mem = int(parse_bytes(max_mem))
        if max_mem <= 0:
            raise RechunkInputError(f"max_mem must be a positive number of bytes, not {max_mem}")
    rechunk = ZarrRechunk(job, storage=storage, progress=progress, client=client, max_mem=max_mem)
    return rechunk.execute() if compute else rechunk


class ZarrRechunk:
    """**Loop-confined** (the caller's thread). A checked :func:`rechunk_zarr` call, not run.

    Returned by ``rechunk_zarr(..., compute=False)``, like rechunker's ``Rechunked``:
    :attr:`plan` says what each array's rechunk will do, :meth:`execute` runs it once, and
    :meth:`to_dask` hands over the dask graph instead.
    """

    def __init__(
        self,
        job: ZarrRechunkJob,
        *,
        storage: str | None,
        progress: bool,
        client: distributed.Client | str | None,
        max_mem: int | None,
    ) -> None:
        self._job = job
        self._storage = storage
        self._progress = progress
        self._client = client
        self._max_mem = max_mem
        self._done = False
        self._target_open = False  # the run record is written (or checked, to resume)

    @functools.cached_property
    def plan(self) -> dict[str, Any]:
        """Array name -> the engine's :class:`RechunkPlan` (``None``: copied as it is)."""
        limit = self._max_mem
        with dask.config.set(_budget_settings(limit)):
            return {
                lay.name: (
                    plan_array(_read(lay), lay.write_chunks, block_size_limit=limit)
                    if lay.rechunked
                    else None
                )
                for lay in self._job.layouts
            }

    def __repr__(self) -> str:
        job = self._job
        n = sum(p is not None for p in self.plan.values())
        size = format_bytes(sum(lay.nbytes for lay in job.layouts))
        budget = f", max_mem {format_bytes(self._max_mem)}" if self._max_mem else ""
        return (
            f"<ZarrRechunk {describe(job.root)} -> {job.dest}: {len(job.layouts)} array(s), "
            f"{n} rechunked, {size}{budget}; call .execute()>"
        )

    def _repr_html_(self) -> str:
        from rechunk_p2p.html_tables import table_html

        rows = [
            (name or "(array)", "copied as it is" if p is None else dict(p.rows())["chunks"])
            for name, p in self.plan.items()
        ]
        return table_html(repr(self)[1:-1], rows)

    def to_dask(self) -> list[Any]:
        """The rechunk as a list holding one ``dask.delayed`` object: computing it writes
        every chunk of the target, then its consolidated metadata where the source had it,
        and returns ``{"chunks": <chunks written>}`` (nothing of the data).

        Creates the empty target first (as rechunker does when it plans). For when the
        rechunk is part of a larger graph; :meth:`execute` is the usual way (it also reports,
        and stops cleanly on failure). Either can be used once; not with ``resume``.
        """
        if self._job.dest.resume:
            raise RechunkInputError("to_dask() writes a new target; resume with execute()")
        self._claim()
        try:
            client = distributed.get_client()
        except ValueError:
            client = None
        written, _ = self._prepare(client)
        job = self._job
        fmt = job.zarr_format if is_consolidated(job.root) else None
        return [lazy_run(job.dest.location, fmt, written)]

    def _prepare(
        self, client: distributed.Client | None
    ) -> tuple[list[da.Array], list[set[tuple[int, ...]]]]:
        """Create the empty target (marked unfinished), or open the unfinished one to
        resume; the arrays whose tasks write it, and per array the chunks already written."""
        job = self._job
        storage = self._storage
        if storage is None and client is not None:
            storage = _storage_within(self._max_mem, self.plan, client)
        store = root_store(job.dest.location)
        record = run_record_of(describe(job.root), job.layouts, job.zarr_format)
        if job.dest.resume:
            check_resumable(read_run_record(store), record, str(job.dest))
            self._target_open = True
            if client is not None:  # a lost client's writes may still be running there
                wait_for_writers(client)
            targets = open_target(job)
            remove_torn_writes(job.dest.location)
            done = done_chunks(store, len(job.layouts))
        else:
            job.dest.clear()
            write_run_record(store, record)  # first: the target is recognisably unfinished
            self._target_open = True
            targets = create_target(job)
            done = [set() for _ in job.layouts]
        arrays = source_arrays(job.layouts, storage=storage, limit=self._max_mem)
        return write_arrays(arrays, targets, store), done

    def _claim(self) -> None:
        if self._done:
            raise RechunkInputError(f"{self!r} was executed already")
        self._done = True

    def execute(self) -> ZarrRechunkReport:
        """Run the rechunk (once) and return its report.

        If a task fails, the target is removed once every write has stopped; if the run is
        stopped otherwise (an interrupt, a lost cluster), the target stays marked unfinished
        for ``resume=True``.
        """
        self._claim()
        job = self._job
        with client_for(self._client) as client, contextlib.ExitStack() as probing:
            start = time.perf_counter()
            try:
                # the graph first, then the workers are asked: a command's workers may still
                # be setting up the engine (cluster.register_in_background) meanwhile
                written, done = self._prepare(client)
                graph, keys = optimized_writes(*missing_keys(written, done))
                probe = probing.enter_context(lag_probe(client))
                before = cluster_statistics(client)
                run_writes(
                    client, graph, keys, progress=self._progress, on_task_error=job.dest.remove
                )
            except BaseException as e:  # (an interrupt too, while the graph is built)
                if self._target_open and is_unfinished(job.dest.location):
                    _note(
                        e,
                        f"{job.dest} holds an unfinished run: resume it with resume=True "
                        "(--resume), or start over with overwrite=True (--overwrite)",
                    )
                raise
            if is_consolidated(job.root):
                consolidate(job.dest.location, job.zarr_format)
            finish_run(root_store(job.dest.location))  # last: the target is whole
            seconds = time.perf_counter() - start
            after = cluster_statistics(client)
        return ZarrRechunkReport(
            source=describe(job.root),
            target=str(job.dest),
            zarr_format=job.zarr_format,
            arrays=job.layouts,
            seconds=seconds,
            statistics={k: after.get(k, 0) - before.get(k, 0) for k in after},
            loop_lag=lag_of(probe),
            chunks_written=len(keys),
            chunks_resumed=sum(len(d) for d in done),
        )


def _note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error`` (shown under its traceback; the CLI prints it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def plan_zarr(
    source: Any,
    chunks: Any,
    *,
    shards: Any = None,
    n_workers: int | None = None,
    coordinates: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, tuple[ArrayLayout, Any]]:
    """Plan :func:`rechunk_zarr` without running it.

    Returns
    -------
    dict
        Array name (``""`` for a bare array) -> ``(layout, plan)``, where ``plan`` is the
        engine's :class:`RechunkPlan`, or ``None`` for an array copied in its own layout.
    """
    root = open_source(source, storage_options)
    layouts = resolve_layouts(root, chunks, shards=shards, coordinates=coordinates)
    return {
        lay.name: (lay, plan_array(_read(lay), lay.write_chunks, n_workers=n_workers))
        if lay.rechunked
        else (lay, None)
        for lay in layouts
    }


def _read(layout: ArrayLayout) -> da.Array:
    """The source as a dask array: in the source's chunks if it is rechunked, else in
    the chunks it is written in."""
    chunks = layout.source.chunks if layout.rechunked else layout.write_chunks
    return da.from_zarr(layout.source, chunks=chunks)


def _storage_within(max_mem: int | None, plans: Mapping[str, Any], client: Any) -> str | None:
    """With a budget: memory if a worker's share of the shuffled bytes fits it, else disk."""
    if max_mem is None:
        return None
    workers = max(len(client.scheduler_info(n_workers=-1)["workers"]), 1)
    shuffled = sum(p.bytes_shuffled for p in plans.values() if p is not None)
    return "memory" if shuffled / workers <= max_mem else "disk"


def _budget_settings(max_mem: int | None) -> dict[str, Any]:
    """The engine settings of a ``max_mem`` budget: half of it for pieces queued to send,
    and at most an eighth of it for the input chunks a transfer task joins (it holds two to
    three times that while it cuts them)."""
    if max_mem is None:
        return {}
    from rechunk_p2p.settings import ClientSettings

    joined = min(ClientSettings.read().transfer_group_bytes, max_mem // 8)
    return {
        "rechunk-p2p.comm.run-buffer-bytes": max(max_mem // 2, 1),
        "rechunk-p2p.transfer-group-bytes": joined,
    }


def source_arrays(
    layouts: tuple[ArrayLayout, ...],
    *,
    storage: str | None = None,
    limit: int | None = None,
) -> list[da.Array]:
    """Lazy arrays of every array in its target layout: each chunk is one whole target
    chunk (or shard), so that one task writes it, once, without locks.

    ``storage`` is set around graph construction; ``limit`` (a ``max_mem`` budget) is the
    rechunk's ``block_size_limit``, and half of it bounds each worker's queue of the
    rechunk's pieces waiting to be sent.
    """
    settings = _budget_settings(limit)
    if storage:
        settings["rechunk-p2p.storage"] = storage
    with dask.config.set(settings):
        return [
            rechunk_array(_read(lay), lay.write_chunks, block_size_limit=limit)
            if lay.rechunked
            else _read(lay)
            for lay in layouts
        ]
