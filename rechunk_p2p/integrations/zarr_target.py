"""The target of a zarr rechunk: its groups and empty arrays, made like the source's.

Where it runs: the client, before any task is submitted (metadata only), and after the
rechunk (consolidating the target's metadata where the source's was).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import zarr

from rechunk_p2p.integrations.zarr_input import (
    ArrayLayout,
    ZarrFormat,
    ZarrRechunkJob,
    dimension_names,
    local_root,
)


def create_target(job: ZarrRechunkJob) -> list[zarr.Array]:
    """Create the target's groups and empty arrays; return the arrays in layout order."""
    root, layouts, location = job.root, job.layouts, job.dest.location
    fmt, options = job.zarr_format, job.array_options
    if isinstance(root, zarr.Array):
        kwargs = _array_kwargs(layouts[0], fmt, options)
        return [zarr.create_array(location, zarr_format=fmt, **kwargs)]  # a group sets it
    # "a": the target holds the run record already (nothing else: it was cleared or new)
    group = zarr.open_group(location, mode="a", zarr_format=fmt, attributes=dict(root.attrs))
    subgroups = sorted(
        name for name, node in root.members(max_depth=None) if isinstance(node, zarr.Group)
    )
    for name in subgroups:
        group.create_group(name, attributes=dict(root[name].attrs))
    return [group.create_array(lay.name, **_array_kwargs(lay, fmt, options)) for lay in layouts]


def open_target(job: ZarrRechunkJob) -> list[zarr.Array]:
    """The arrays of an unfinished target (to resume it), in layout order."""
    location = job.dest.location
    if isinstance(job.root, zarr.Array):
        return [zarr.open_array(location, mode="r+", zarr_format=job.zarr_format)]
    group = zarr.open_group(location, mode="r+", zarr_format=job.zarr_format)
    return [cast(zarr.Array, group[lay.name]) for lay in job.layouts]  # (made as arrays)


def _array_kwargs(
    layout: ArrayLayout, fmt: ZarrFormat, options: Mapping[str, Any]
) -> dict[str, Any]:
    """Keyword arguments of ``create_array`` that reproduce the source in the new layout."""
    src = layout.source
    attrs = dict(src.attrs)
    attrs.pop("_ARRAY_DIMENSIONS", None)
    kwargs: dict[str, Any] = {
        "shape": src.shape,
        "dtype": src.dtype,
        "chunks": layout.chunks,
        "shards": layout.shards,
    }
    if src.fill_value is not None or fmt == 2:
        kwargs["fill_value"] = src.fill_value
    dims = dimension_names(src)
    if fmt == 3:
        kwargs["dimension_names"] = dims
    elif dims is not None:
        attrs["_ARRAY_DIMENSIONS"] = list(dims)
    if src.metadata.zarr_format == fmt:
        kwargs.update(_codecs(src))
    kwargs["attributes"] = attrs
    kwargs.update(options)
    return kwargs


def _codecs(src: zarr.Array) -> dict[str, Any]:
    """Codecs, order and chunk key encoding of ``src``, to reuse in the same format."""
    kwargs: dict[str, Any] = {"compressors": src.compressors, "filters": src.filters}
    if src.metadata.zarr_format == 3:
        kwargs["serializer"] = src.serializer
        kwargs["chunk_key_encoding"] = src.metadata.chunk_key_encoding
    else:
        separator = src.metadata.dimension_separator
        kwargs["chunk_key_encoding"] = {"name": "v2", "separator": separator}
        kwargs["order"] = src.order  # format 3 keeps the order in the runtime config
    return kwargs


def is_consolidated(root: zarr.Array | zarr.Group) -> bool:
    return isinstance(root, zarr.Group) and root.metadata.consolidated_metadata is not None


def describe(root: zarr.Array | zarr.Group) -> str:
    return local_root(root.store, root.path) or repr(root)
