"""Rechunk xarray Datasets and DataArrays with the P2P engine.

Where it runs: client (the caller's thread). Builds lazy dask graphs only; nothing is
computed here. :func:`rechunk_p2p.api.rechunk` hands xarray objects to
:func:`rechunk_xarray`, which sends every dask array back through the engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import xarray as xr
from dask.utils import format_bytes

from rechunk_p2p.arrays import normalize, plan_array, rechunk_array
from rechunk_p2p.errors import RechunkInputError, RechunkTypeError

T_Xarray = TypeVar("T_Xarray", xr.Dataset, xr.DataArray)

#: Encoding keys that describe the on-disk layout of the source, not the data.
_LAYOUT_KEYS = ("chunks", "preferred_chunks", "shards")


def rechunk_xarray(
    obj: T_Xarray,
    chunks: Any = "auto",
    *,
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
) -> T_Xarray:
    """Rechunk every dask-backed variable of ``obj`` with the P2P engine.

    Parameters
    ----------
    obj : xarray.Dataset or xarray.DataArray
        The object to rechunk. Variables that are not dask-backed are first chunked the
        way ``obj.chunk()`` would chunk them; index coordinates stay in memory, as with
        ``obj.chunk()``.
    chunks : dict, int, str or tuple
        Chunks keyed by dimension name (``{"time": -1, "lat": 90}``); dimensions not
        named keep their chunks. A single spec (``-1``, ``"auto"``, ``100``) applies to
        every dimension; for a DataArray a tuple gives one spec per dimension, in order.
        Each spec is anything :meth:`dask.array.Array.rechunk` accepts for one axis.
    threshold, block_size_limit, balance
        As for :meth:`dask.array.Array.rechunk`.

    Returns
    -------
    xarray.Dataset or xarray.DataArray
        The same kind of object with the same names, coordinates, attributes and
        encoding. The layout keys of the encoding (``chunks``, ``preferred_chunks``),
        where present, describe the new chunks so that ``to_zarr`` writes the new
        layout; ``shards`` is dropped from rechunked variables because the source's
        shard shape need not fit the new chunks.

    Raises
    ------
    RechunkInputError
        ``chunks`` names a dimension that ``obj`` does not have, or a tuple does not
        match the number of dimensions.
    RechunkTypeError
        ``obj`` is not an xarray object, or a variable is chunked by something other
        than dask.

    Examples
    --------
    >>> ds2 = rechunk_xarray(ds, {"time": -1, "lat": 90, "lon": 180})  # doctest: +SKIP
    """
    if not isinstance(obj, xr.Dataset | xr.DataArray):
        raise RechunkTypeError(
            f"rechunk_xarray needs an xarray Dataset or DataArray, got {type(obj).__name__}"
        )
    by_dim = chunks_by_dimension(obj, chunks)
    del threshold  # dask's tasks-rechunk tuning: a P2P shuffle has no intermediate steps
    kwargs = {"block_size_limit": block_size_limit, "balance": balance}
    coords = {
        name: _rechunk_variable(name, var, by_dim, kwargs)
        for name, var in obj.coords.variables.items()
        if name not in obj.indexes
    }
    if isinstance(obj, xr.DataArray):
        new = _rechunk_variable(obj.name, obj.variable, by_dim, kwargs)
        out = obj.copy(data=new.data).assign_coords(coords)
        out.encoding = dict(new.encoding)
        return out
    data_vars = {
        name: _rechunk_variable(name, obj.variables[name], by_dim, kwargs) for name in obj.data_vars
    }
    return obj.assign_coords(coords).assign(data_vars)


@dataclass(frozen=True)
class DatasetRechunkPlan:
    """**Immutable.** The plans of every variable an xarray rechunk changes, with totals.

    ``plans`` maps each variable whose chunks change to its :class:`RechunkPlan`; variables
    that keep their chunks are not listed.
    """

    plans: Mapping[Hashable, Any]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.plans.values())

    @property
    def bytes_shuffled(self) -> int:
        return sum(p.bytes_shuffled for p in self.plans.values())

    @property
    def n_tasks(self) -> int:
        return sum(p.n_tasks for p in self.plans.values())

    @property
    def n_pieces(self) -> int:
        """Pieces the shuffles cut (one input chunk's part of one output chunk)."""
        return sum(p.n_pieces for p in self.plans.values())

    def rows(self) -> list[tuple[str, str]]:
        total = (
            f"{len(self.plans)} variable(s), {format_bytes(self.nbytes)}; "
            f"{format_bytes(self.bytes_shuffled)} shuffled in {self.n_pieces} pieces; "
            f"{self.n_tasks} tasks"
        )
        per_var = [
            (str(name), f"{rows['chunks']}; {rows['shuffled'].split(';')[0]} shuffled")
            for name, rows in ((n, dict(p.rows())) for n, p in self.plans.items())
        ]
        return [("total", total), *per_var]

    def __repr__(self) -> str:
        return "\n".join(["DatasetRechunkPlan", *(f"  {k:<12} {v}" for k, v in self.rows())])

    def _repr_html_(self) -> str:
        from rechunk_p2p.html_tables import table_html

        return table_html("DatasetRechunkPlan", self.rows())


def plan_xarray(
    obj: xr.Dataset | xr.DataArray,
    chunks: Any = "auto",
    *,
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
    n_workers: int | None = None,
) -> DatasetRechunkPlan:
    """What :func:`rechunk_xarray` would do to ``obj``, variable by variable, with totals.

    Parameters and errors as for :func:`rechunk_xarray`; ``n_workers`` as for
    :func:`rechunk_p2p.plan`.
    """
    if not isinstance(obj, xr.Dataset | xr.DataArray):
        raise RechunkTypeError(
            f"plan_xarray needs an xarray Dataset or DataArray, got {type(obj).__name__}"
        )
    by_dim = chunks_by_dimension(obj, chunks)
    variables = dict(obj.coords.variables)
    if isinstance(obj, xr.DataArray):
        variables[obj.name] = obj.variable
    else:
        variables.update(obj.data_vars.variables)
    plans = {}
    for name, var in variables.items():
        own = {d: spec for d, spec in by_dim.items() if d in var.dims}
        if var.ndim == 0 or name in obj.indexes or not own:
            continue
        data = var.chunk().data if var.chunks is None else var.data
        axes = {var.dims.index(d): spec for d, spec in own.items()}
        the_plan = _variable_plan(name, var.dims, data, axes, block_size_limit, balance, n_workers)
        if the_plan.old_chunks != the_plan.new_chunks:
            plans[name] = the_plan
    return DatasetRechunkPlan(plans)


def _variable_plan(
    name: Hashable,
    dims: tuple[Hashable, ...],
    data: Any,
    axes: dict[int, Any],
    block_size_limit: int | None,
    balance: bool,
    n_workers: int | None,
) -> Any:
    try:
        new = normalize(data, axes, block_size_limit=block_size_limit, balance=balance)
        return plan_array(data, new, n_workers=n_workers)
    except RechunkInputError as e:
        raise _for_variable(e, name, dims, data) from None


def _for_variable(
    error: RechunkInputError, name: Hashable, dims: tuple[Hashable, ...], data: Any
) -> Any:
    """``error`` reworded for a variable: its name where the error named dask's name of
    its array ``data`` (``open_dataset-t2m-49c0...``, which the user never saw), and
    dimension names instead of axes."""
    import re

    text = re.sub(
        r"along axis (\d+)", lambda m: f"along dimension {dims[int(m.group(1))]!r}", str(error)
    )
    label = f"variable {name!r}"
    array = f"rray {getattr(data, 'name', None)}"
    if array in text:
        text = text.replace(f"a{array}", label).replace(f"A{array}", label.capitalize())
        return RechunkInputError(text)
    return RechunkInputError(f"{label}: {text}")


def chunks_by_dimension(obj: xr.Dataset | xr.DataArray, chunks: Any) -> dict[Hashable, Any]:
    """Expand ``chunks`` into a spec per dimension name, checking every name.

    Parameters
    ----------
    obj : xarray.Dataset or xarray.DataArray
    chunks : dict, int, str or tuple
        See :func:`rechunk_xarray`.

    Returns
    -------
    dict
        Dimension name -> chunk spec for one axis, only for the dimensions to change.

    Examples
    --------
    >>> da = xr.DataArray(np.zeros((2, 3)), dims=("y", "x"))  # doctest: +SKIP
    >>> chunks_by_dimension(da, (1, -1))  # doctest: +SKIP
    {'y': 1, 'x': -1}
    """
    dims = tuple(obj.dims)
    if isinstance(chunks, Mapping):
        unknown = [d for d in chunks if d not in dims]
        if unknown:
            raise RechunkInputError(
                f"chunks name dimension(s) {_names(unknown)} that this "
                f"{type(obj).__name__} does not have; its dimensions are {_names(dims)}"
            )
        return dict(chunks)
    if isinstance(chunks, tuple | list):
        if isinstance(obj, xr.Dataset):
            raise RechunkInputError(
                "a tuple of chunks is ambiguous for a Dataset; pass a dict keyed by "
                f"dimension name, e.g. {{{dims[0]!r}: ...}}"
                if dims
                else "a tuple of chunks is ambiguous for a Dataset; pass a dict"
            )
        if len(chunks) != len(dims):
            raise RechunkInputError(
                f"chunks {tuple(chunks)!r} give {len(chunks)} dimension(s) but the "
                f"DataArray has {len(dims)}: {_names(dims)}"
            )
        return dict(zip(dims, chunks, strict=True))
    return dict.fromkeys(dims, chunks)


def _rechunk_variable(
    name: Hashable, var: xr.Variable, by_dim: Mapping[Hashable, Any], kwargs: dict[str, Any]
) -> xr.Variable:
    """Return ``var`` with its data rechunked through the engine (0-d variables as they are)."""
    if var.ndim == 0:
        return var
    own = {d: spec for d, spec in by_dim.items() if d in var.dims}
    if var.chunks is None:
        var = var.chunk(own)  # what obj.chunk() does to in-memory and lazily loaded data
    elif not _is_dask(var):
        raise RechunkTypeError(
            f"variable {name!r} is chunked by {type(var._data).__name__}, not dask; "
            "rechunk_p2p only rechunks dask arrays"
        )
    if not own:
        return var
    axes = {var.dims.index(d): spec for d, spec in own.items()}
    try:
        data = rechunk_array(var.data, axes, **kwargs)
    except RechunkInputError as e:
        raise _for_variable(e, name, var.dims, var.data) from None
    # a copy even if unchanged: the encoding changes (xarray types ``data`` as its own duck
    # array protocols, which a dask array follows)
    new = var.copy(deep=False, data=cast(Any, data))
    new.encoding = _layout_encoding(var.encoding, var.dims, data.chunks)
    return new


def _is_dask(var: xr.Variable) -> bool:
    import dask.array as da

    return isinstance(var.data, da.Array)


def _layout_encoding(
    encoding: Mapping[str, Any], dims: tuple[Hashable, ...], chunks: tuple[tuple[int, ...], ...]
) -> dict[str, Any]:
    """Rewrite the layout keys present in ``encoding`` to describe ``chunks``.

    Regular chunks (all equal but a smaller last one) are written as the new chunk shape;
    irregular chunks cannot be a zarr chunk shape, so the keys are dropped and the writer
    chooses.
    """
    enc = dict(encoding)
    enc.pop("shards", None)
    regular = all(len(set(c[:-1])) <= 1 and c[-1] <= c[0] for c in chunks if c)
    shape = tuple(c[0] if c else 0 for c in chunks)
    for key in ("chunks", "preferred_chunks"):
        if key not in enc:
            continue
        if not regular:
            del enc[key]
        elif key == "chunks":
            enc[key] = shape
        else:
            enc[key] = dict(zip(dims, shape, strict=True))
    return enc


def _names(names: Any) -> str:
    return ", ".join(repr(n) for n in names) or "(none)"
