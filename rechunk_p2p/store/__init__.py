"""Buffers of a P2P rechunk: thread-safe stores where received pieces wait for assembly.

Where it runs: offload pool and task threads (blocking; never on the event loop).
:mod:`~rechunk_p2p.store.base` holds the interface and the helpers both stores share, each
store imports it, and this package picks a store by kind (:func:`make_store`).
"""

from __future__ import annotations

import os

import numpy as np

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.planning import Partial
from rechunk_p2p.store.assembling import AssemblingMemoryStore
from rechunk_p2p.store.base import STORE_KINDS, Piece, PieceStore, StoreKind, StoreStatistics
from rechunk_p2p.store.disk import DiskPieceStore
from rechunk_p2p.store.memory import MemoryPieceStore
from rechunk_p2p.store.split import SplitStore

__all__ = [
    "AssemblingMemoryStore",
    "DiskPieceStore",
    "MemoryPieceStore",
    "Piece",
    "PieceStore",
    "SplitStore",
    "StoreStatistics",
    "make_store",
]


def make_store(
    kind: StoreKind,
    *,
    dtype: np.dtype,
    directory: str | os.PathLike[str] | None,
    name: str,
    buffer_bytes: int = 0,
    direct_io: bool | None = None,
    partial: Partial | None = None,
    in_memory: np.ndarray | None = None,
    io_pool: OffloadPool | None = None,
) -> PieceStore:
    """Create an empty piece store (every kind does what :class:`PieceStore` says).

    Parameters
    ----------
    kind
        ``"disk"`` to spill pieces to local disk, ``"memory"`` to keep them in memory, or
        ``"memory+disk"`` to assemble the outputs ``in_memory`` in memory and spill the
        others (:class:`SplitStore`). ``"auto"`` must be resolved by the caller before this
        point.
    dtype
        The dtype of every piece written to the store.
    directory
        For ``"disk"``: the parent directory under which a sub-directory named after
        ``name`` is created on the first write (``None``: the system temporary directory).
        Ignored for ``"memory"``.
    name
        Names the store in error messages (and its directory); for example the rechunk's
        id, run id and sub-shuffle.
    buffer_bytes
        For ``"disk"``: bytes of pieces gathered before a write (see
        :class:`DiskPieceStore`). Ignored for ``"memory"``.
    direct_io
        For ``"disk"``: whether the data file bypasses the page cache (``None``: decided by
        the store's first write; see :class:`DiskPieceStore`). Ignored for ``"memory"``.
    partial
        For ``"memory"``: the sub-shuffle, whose output shapes and places of each input's
        piece are known. Given (and the dtype not object), the store fills outputs as
        pieces arrive (:class:`AssemblingMemoryStore`); else it keeps the pieces
        (:class:`MemoryPieceStore`, for outputs whose shape is not known in advance).
        Required for ``"memory+disk"``.
    in_memory
        For ``"memory+disk"``: one boolean per flat output, true for those held in memory.
    io_pool
        For ``"disk"``: the worker's store I/O pool (see :class:`DiskPieceStore`).

    Examples
    --------
    >>> import numpy as np
    >>> store = make_store("memory", dtype=np.dtype("f8"), directory=None, name="doc")
    >>> store.write_blocking([(0, 1, np.ones(3))])
    24
    >>> [(i, a.tolist()) for i, a in store.read_blocking(0)]
    [(1, [1.0, 1.0, 1.0])]
    >>> store.close_blocking()
    """
    if kind == "memory":
        if partial is not None and not dtype.hasobject:
            return AssemblingMemoryStore(dtype, name, partial)
        return MemoryPieceStore(dtype, name)
    if kind == "disk":
        return DiskPieceStore(dtype, directory, name, buffer_bytes, direct_io, io_pool)
    if kind == "memory+disk":
        if partial is None or in_memory is None or dtype.hasobject:
            raise RechunkInputError(
                f"Store {name!r}: 'memory+disk' needs the sub-shuffle and the outputs held "
                "in memory, and a dtype other than object"
            )
        return SplitStore(
            AssemblingMemoryStore(dtype, name, partial),
            DiskPieceStore(dtype, directory, name, buffer_bytes, direct_io, io_pool),
            in_memory,
        )
    raise RechunkInputError(
        f"Unknown piece store kind {kind!r} for store {name!r}; expected one of "
        f"{STORE_KINDS} (resolve 'auto' before creating the store)."
    )
