"""The one check of requested chunk sizes, shared by every entry point (``rechunk``,
``plan``, ``rechunk_zarr``, ``plan_zarr``, the CLI, xarray objects).

Where it runs: the caller's thread, before anything is read or written; pure.

dask's ``normalize_chunks`` fails on a zero size with a bare ``ZeroDivisionError``, turns
``-3`` into chunks of 1 and ``-1000`` into no change at all, and rounds ``2.5`` silently:
each is refused here with one line that names the axis; so is a byte size of zero
(``"0MiB"``), which dask reads as no change.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from dask.utils import parse_bytes

from rechunk_p2p.errors import RechunkInputError

_ALLOWED = "a positive size, -1 (the whole axis), None (unchanged), 'auto' or a byte size"


def check_chunk_sizes(per_axis: tuple[Any, ...], shape: tuple[int, ...], label: str) -> None:
    """Refuse a chunk size that is zero, negative other than -1, or not a whole number.

    ``per_axis`` holds one entry per axis (as dask takes it after dict keys were resolved):
    a size, ``-1``, ``None``, ``"auto"``, a byte string, or explicit chunk lengths (each a
    whole number >= 0, zero only where the axis is empty or as dask allows between
    others). ``label`` names the array in the message.

    >>> check_chunk_sizes((10, -1, None, "auto"), (100, 5, 5, 5), "x")
    >>> try:
    ...     check_chunk_sizes((0,), (100,), "array 't2m'")
    ... except RechunkInputError as e:
    ...     print(str(e)[:48])
    Chunk size 0 along axis 0 (length 100) of array
    """
    for axis, (size, length) in enumerate(zip(per_axis, shape)):
        if isinstance(size, str):
            _check_byte_size(size, axis, length, label)
            continue
        if size is None:
            continue
        if isinstance(size, tuple | list):
            bad = [s for s in size if not (_whole(s) and s >= 0) and not _unknown(s)]
            if bad:
                raise RechunkInputError(
                    f"Chunk lengths {tuple(size)!r} along axis {axis} of {label} hold "
                    f"{bad[0]!r}; each must be a whole number >= 0"
                )
            continue
        if _unknown(size):
            continue  # an unknown size, as in an array's own chunks
        if _whole(size) and (size == -1 or size > 0 or (size == 0 and length == 0)):
            continue
        raise RechunkInputError(
            f"Chunk size {size!r} along axis {axis} (length {length}) of {label} is not {_ALLOWED}"
        )


def _check_byte_size(size: str, axis: int, length: int, label: str) -> None:
    """A string size is ``"auto"`` or a positive byte size (``"64MiB"``): dask reads
    ``"0MiB"`` as a limit of zero bytes and leaves the axis as it is."""
    if size.strip().lower() == "auto":
        return
    try:
        nbytes = parse_bytes(size)
    except (ValueError, TypeError):
        nbytes = None
    if nbytes is None or nbytes <= 0:
        raise RechunkInputError(
            f"Chunk size {size!r} along axis {axis} (length {length}) of {label} is not "
            "'auto' or a positive byte size like '64MiB'"
        )


def _whole(value: Any) -> bool:
    """Whether ``value`` is an integer (not a bool), or a float holding one."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return True
    return isinstance(value, numbers.Real) and float(value).is_integer()


def _unknown(value: Any) -> bool:
    """Whether ``value`` is NaN (dask's unknown chunk size)."""
    return isinstance(value, float) and math.isnan(value)
