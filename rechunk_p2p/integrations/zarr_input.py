"""Check the input of a zarr rechunk and resolve the layout of every target array.

Where it runs: client, pure apart from reading zarr metadata and looking at the target
path (no array data, no cluster). Everything here raises :class:`RechunkInputError` (or
:class:`RechunkTypeError`) with a message naming the array and the problem, so that
:func:`rechunk_p2p.integrations.zarr.rechunk_zarr` fails before any data moves.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import zarr
from dask.array.core import normalize_chunks

from rechunk_p2p import config
from rechunk_p2p.chunk_sizes import check_chunk_sizes
from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.integrations.zarr_destination import Target, is_url, local_root

#: A zarr format this engine reads and writes
ZarrFormat = Literal[2, 3]

__all__ = [
    "ARRAY_OPTIONS",
    "ArrayLayout",
    "ZarrRechunkJob",
    "check_zarr_rechunk",
    "dimension_names",
    "local_root",
    "open_source",
    "resolve_layouts",
]


#: Keyword arguments of :func:`zarr.create_array` that ``array_options`` may override.
ARRAY_OPTIONS = frozenset(
    {"compressors", "filters", "serializer", "fill_value", "order", "chunk_key_encoding"}
)


@dataclass(frozen=True)
class ZarrRechunkJob:
    """**Immutable.** A checked :func:`rechunk_zarr` call: nothing has been written yet."""

    root: zarr.Array | zarr.Group
    layouts: tuple[ArrayLayout, ...]
    zarr_format: ZarrFormat
    array_options: Mapping[str, Any]
    dest: Target


def check_zarr_rechunk(
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
    coordinates: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> ZarrRechunkJob:
    """Check the arguments of :func:`rechunk_zarr` (same meaning) without writing anything.

    Reads metadata only and needs no cluster. Raises what :func:`rechunk_zarr` raises for
    bad input; returns the checked job.
    """
    root = open_source(source, storage_options)
    layouts = resolve_layouts(root, chunks, shards=shards, coordinates=coordinates)
    fmt = _target_format(root, zarr_format, layouts)
    if fmt == 2:  # arrays copied from sharded format 3 sources lose their shards
        layouts = tuple(replace(lay, shards=None) for lay in layouts)
    options = _check_array_options(array_options)
    if storage is not None:
        config.storage(storage)
    dest = Target.of(
        target, root, overwrite=overwrite, resume=resume, storage_options=storage_options
    )
    return ZarrRechunkJob(root, layouts, fmt, options, dest)


def open_source(
    source: Any, storage_options: Mapping[str, Any] | None = None
) -> zarr.Array | zarr.Group:
    """Open ``source`` read-only: a zarr Array or Group as it is, else a path, URL or store
    (``storage_options`` go to fsspec for a URL such as ``s3://bucket/data.zarr``).

    Raises
    ------
    RechunkInputError
        Nothing readable by zarr is at ``source``.
    """
    if isinstance(source, zarr.Array | zarr.Group):
        return source
    if isinstance(source, str | os.PathLike) and not is_url(source):
        source = os.path.expanduser(os.fspath(source))
        if not os.path.exists(source):
            raise RechunkInputError(f"source {source!r} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
            options = dict(storage_options) if storage_options else None
            return zarr.open(source, mode="r", storage_options=options)
    except (FileNotFoundError, zarr.errors.BaseZarrError) as e:
        raise RechunkInputError(f"source {source!r} is not a zarr array or group ({e})") from e


# --- layouts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayLayout:
    """**Immutable.** One source array and the layout it gets in the target.

    Attributes
    ----------
    name : str
        Path of the array relative to the source group (``""`` for a bare array).
    source : zarr.Array
    chunks : tuple of int
        Chunk shape of the target array.
    shards : tuple of int or None
        Shard shape of the target array (format 3), or ``None``.
    rechunked : bool
        ``False`` when no chunks were asked for this array: it is copied in its own layout.
    """

    name: str
    source: zarr.Array
    chunks: tuple[int, ...]
    shards: tuple[int, ...] | None
    rechunked: bool

    @property
    def write_chunks(self) -> tuple[int, ...]:
        """The unit one task writes: a shard if sharded, else a chunk."""
        return self.shards or self.chunks

    @property
    def nbytes(self) -> int:
        """Uncompressed size of the array."""
        return int(math.prod(self.source.shape)) * self.source.dtype.itemsize

    @property
    def dims(self) -> tuple[str | None, ...] | None:
        return dimension_names(self.source)


def dimension_names(arr: zarr.Array) -> tuple[str | None, ...] | None:
    """Dimension names of ``arr``: ``dimension_names`` (format 3) or the
    ``_ARRAY_DIMENSIONS`` attribute (format 2, as written by xarray), else ``None``."""
    if arr.metadata.zarr_format == 3:
        names: Any = getattr(arr.metadata, "dimension_names", None)  # (format 3's field)
    else:
        names = arr.attrs.get("_ARRAY_DIMENSIONS")
    if not isinstance(names, list | tuple) or len(names) != arr.ndim:
        return None
    return tuple(names)


def resolve_layouts(
    root: zarr.Array | zarr.Group, chunks: Any, *, shards: Any = None, coordinates: bool = False
) -> tuple[ArrayLayout, ...]:
    """Target layout of every array under ``root``, in a stable order.

    Parameters
    ----------
    root : zarr.Array or zarr.Group
    chunks, shards, coordinates
        As for :func:`rechunk_p2p.integrations.zarr.rechunk_zarr`.

    Raises
    ------
    RechunkInputError
        Unknown dimension or array name, an axis out of range, chunks that resolve to an
        irregular grid, shards that are not multiples of the chunks.
    """
    if isinstance(root, zarr.Array):
        arrays = [("", root)]
        per_array = [(_array_axes("", root, chunks), _array_axes("", root, shards))]
    else:
        arrays = sorted(
            (name, node)
            for name, node in root.members(max_depth=None)
            if isinstance(node, zarr.Array)
        )
        if not arrays:
            raise RechunkInputError("the source group holds no arrays")
        keys = _GroupKeys.of(arrays, coordinates)
        per_array = [
            (keys.axes(name, arr, chunks, "chunks"), keys.axes(name, arr, shards, "shards"))
            for name, arr in arrays
        ]
    return tuple(
        _layout(name, arr, axes, shard_axes)
        for (name, arr), (axes, shard_axes) in zip(arrays, per_array, strict=True)
    )


@dataclass(frozen=True)
class _GroupKeys:
    """**Immutable.** The dimension and array names of a group, to interpret dict keys."""

    dims: frozenset[str]
    names: frozenset[str]
    coordinates: bool = False

    @classmethod
    def of(cls, arrays: list[tuple[str, zarr.Array]], coordinates: bool = False) -> _GroupKeys:
        dims = {d for _, a in arrays for d in (dimension_names(a) or ()) if d is not None}
        return cls(frozenset(dims), frozenset(name for name, _ in arrays), coordinates)

    def axes(self, name: str, arr: zarr.Array, spec: Any, what: str) -> dict[int, Any] | None:
        """Per-axis spec for one array of the group, or ``None`` if nothing applies."""
        if spec is None:
            return None
        coordinate = not self.coordinates and is_dimension_coordinate(name, arr)
        if not isinstance(spec, Mapping):
            if isinstance(spec, tuple | list):
                raise RechunkInputError(
                    f"{what} for a group must be a dict keyed by dimension or array name "
                    f"(dimensions: {_names(self.dims)}), not a tuple"
                )
            # one value for every axis of every array; a coordinate keeps its own layout
            return None if coordinate else dict.fromkeys(range(arr.ndim), spec)
        self._check(spec, what)
        if name in spec and name not in self.dims:
            return _array_axes(name, arr, spec[name])
        if coordinate:
            return None  # a coordinate (lat, time) keeps its own layout, as in xarray
        dims = dimension_names(arr) or ()
        return {i: spec[d] for i, d in enumerate(dims) if d in spec} or None

    def _check(self, spec: Mapping[Any, Any], what: str) -> None:
        bad = [k for k in spec if not isinstance(k, str)]
        if bad:
            raise RechunkInputError(
                f"{what} keys {bad} are axis numbers, which only apply to a single array; "
                f"name dimensions instead ({_names(self.dims)})"
            )
        unknown = [k for k in spec if k not in self.dims and k not in self.names]
        if unknown:
            raise RechunkInputError(
                f"unknown dimension name(s) {_names(unknown)} in {what}; the group's "
                f"dimensions are {_names(self.dims)} and its arrays {_names(self.names)}"
            )


def is_dimension_coordinate(name: str, arr: zarr.Array) -> bool:
    """Whether ``arr`` is the coordinate of a dimension: 1-D along a dimension of its name.

    >>> is_dimension_coordinate("grid/lat", type("A", (), {"ndim": 2})())
    False
    """
    if arr.ndim != 1:
        return False
    return dimension_names(arr) == (name.rsplit("/", 1)[-1],)


def _array_axes(name: str, arr: zarr.Array, spec: Any) -> dict[int, Any] | None:
    """Per-axis spec for one array from anything ``rechunk`` accepts (dict keys may be
    dimension names)."""
    if spec is None:
        return None
    label = f"array {name!r}" if name else "the array"
    dims = dimension_names(arr)
    if isinstance(spec, Mapping):
        return {_axis(label, arr, dims, key): value for key, value in spec.items()}
    if isinstance(spec, tuple | list):
        if len(spec) != arr.ndim:
            raise RechunkInputError(
                f"chunks {tuple(spec)!r} give {len(spec)} dimension(s) but {label} has "
                f"{arr.ndim}{_dims_suffix(dims)}"
            )
        return dict(enumerate(spec))
    return dict.fromkeys(range(arr.ndim), spec)


def _axis(label: str, arr: zarr.Array, dims: tuple[str | None, ...] | None, key: Any) -> int:
    if isinstance(key, str):
        if dims is None or key not in dims:
            raise RechunkInputError(
                f"unknown dimension name {key!r}: {label} has dimensions "
                f"{_names(d for d in dims or () if d is not None)}"
            )
        return dims.index(key)
    if isinstance(key, int) and -arr.ndim <= key < arr.ndim:
        return key % arr.ndim
    raise RechunkInputError(
        f"axis {key!r} is out of range: {label} has {arr.ndim} dimension(s){_dims_suffix(dims)}"
    )


def _layout(
    name: str, arr: zarr.Array, axes: dict[int, Any] | None, shard_axes: dict[int, Any] | None
) -> ArrayLayout:
    if axes is None and shard_axes is None:
        return ArrayLayout(name, arr, tuple(arr.chunks), _source_shards(arr), rechunked=False)
    chunks = _regular_chunks(name, arr, axes or {})
    shards = _shards(name, arr, chunks, shard_axes) if shard_axes else None
    return ArrayLayout(name, arr, chunks, shards, rechunked=True)


def _source_shards(arr: zarr.Array) -> tuple[int, ...] | None:
    shards = arr.shards if arr.metadata.zarr_format == 3 else None
    return tuple(shards) if shards else None


def _regular_chunks(name: str, arr: zarr.Array, axes: Mapping[int, Any]) -> tuple[int, ...]:
    """Resolve ``axes`` like ``Array.rechunk`` does; the result must be a zarr chunk shape."""
    label = f"array {name!r}" if name else "the array"
    spec = tuple(arr.chunks[i] if axes.get(i) is None else axes[i] for i in range(arr.ndim))
    check_chunk_sizes(spec, tuple(arr.shape), label)
    try:
        resolved = normalize_chunks(
            spec, arr.shape, dtype=arr.dtype, previous_chunks=tuple(arr.chunks)
        )
    except (ValueError, TypeError) as e:
        raise RechunkInputError(
            f"chunks {spec!r} do not fit {label} of shape {arr.shape}: {e}"
        ) from e
    for axis, c in enumerate(resolved):
        if len(c) > 1 and (len(set(c[:-1])) > 1 or c[-1] > c[0]):
            raise RechunkInputError(
                f"chunks {c!r} on axis {axis} of {label} are irregular; a zarr array has one "
                "chunk shape (all chunks equal, the last one may be smaller)"
            )
    return tuple(max(c[0], 1) if c else 1 for c in resolved)


def _shards(
    name: str, arr: zarr.Array, chunks: tuple[int, ...], axes: Mapping[int, Any]
) -> tuple[int, ...]:
    """Shard shape: a multiple of the chunk shape on every axis (``-1``: whole axis)."""
    label = f"array {name!r}" if name else "the array"
    shards = []
    for i, (size, chunk) in enumerate(zip(arr.shape, chunks, strict=True)):
        value = axes.get(i)
        if value is None:
            shards.append(chunk)
        elif value == -1:
            shards.append(max(1, math.ceil(size / chunk)) * chunk)
        elif isinstance(value, int) and value > 0 and value % chunk == 0:
            shards.append(value)
        else:
            raise RechunkInputError(
                f"shard size {value!r} on axis {i} of {label} must be -1 or a positive "
                f"multiple of the chunk size {chunk}"
            )
    return tuple(shards)


def _names(names: Any) -> str:
    listed = sorted(str(n) for n in names)
    return ", ".join(repr(n) for n in listed) or "(none)"


def _dims_suffix(dims: tuple[str | None, ...] | None) -> str:
    return f" ({', '.join(str(d) for d in dims)})" if dims else ""


# --- options and target ----------------------------------------------------------------


def _target_format(
    root: zarr.Array | zarr.Group, zarr_format: int | None, layouts: tuple[ArrayLayout, ...]
) -> ZarrFormat:
    asked = root.metadata.zarr_format if zarr_format is None else zarr_format
    if asked not in (2, 3):
        raise RechunkInputError(f"zarr_format must be 2 or 3, not {zarr_format!r}")
    fmt: ZarrFormat = 2 if asked == 2 else 3
    if fmt == 2:
        sharded = [lay.name or "the array" for lay in layouts if lay.shards and lay.rechunked]
        if sharded:
            raise RechunkInputError(
                f"zarr format 2 has no shards, but shards were asked for {', '.join(sharded)}; "
                "write format 3 or leave shards out"
            )
    return fmt


def _check_array_options(array_options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(array_options or {})
    unknown = sorted(set(options) - ARRAY_OPTIONS)
    if unknown:
        raise RechunkInputError(
            f"array_options {unknown} are not supported; choose from {sorted(ARRAY_OPTIONS)}"
        )
    return options
