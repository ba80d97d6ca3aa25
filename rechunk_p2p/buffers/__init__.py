"""Buffers of a P2P rechunk: thread-safe stores where received shards wait for assembly.

Where it runs: offload pool and task threads (blocking; never on the event loop).
:mod:`~rechunk_p2p.buffers.base` holds the interface and the helpers both stores share, each
store imports it, and this package picks a store by kind (:func:`make_store`).
"""

from __future__ import annotations

import os

import numpy as np

from rechunk_p2p.buffers.base import STORE_KINDS, Shard, ShardStore, StoreKind, StoreStatistics
from rechunk_p2p.buffers.disk import DiskShardStore
from rechunk_p2p.buffers.memory import MemoryShardStore
from rechunk_p2p.errors import RechunkInputError

__all__ = [
    "DiskShardStore",
    "MemoryShardStore",
    "Shard",
    "ShardStore",
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
) -> ShardStore:
    """Create an empty shard store.

    Parameters
    ----------
    kind
        ``"disk"`` to spill shards to local disk or ``"memory"`` to keep them in memory.
        ``"auto"`` must be resolved by the caller before this point.
    dtype
        The dtype of every shard written to the store.
    directory
        For ``"disk"``: the parent directory under which a sub-directory named after
        ``name`` is created on the first write (``None``: the system temporary directory).
        Ignored for ``"memory"``.
    name
        Names the store in error messages (and its directory); for example the rechunk's
        id, run id and sub-shuffle.
    buffer_bytes
        For ``"disk"``: bytes of shards gathered before a write (see
        :class:`DiskShardStore`). Ignored for ``"memory"``.

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
        return MemoryShardStore(dtype, name)
    if kind == "disk":
        return DiskShardStore(dtype, directory, name, buffer_bytes)
    raise RechunkInputError(
        f"Unknown shard store kind {kind!r} for store {name!r}; expected one of "
        f"{STORE_KINDS} (resolve 'auto' before creating the store)."
    )
