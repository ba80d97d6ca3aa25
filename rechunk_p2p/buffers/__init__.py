"""Buffers of a P2P rechunk: thread-safe stores where received shards wait for assembly.

Where it runs: offload pool and task threads (blocking; never on the event loop).
"""

from __future__ import annotations

from rechunk_p2p.buffers.base import Shard, ShardStore, StoreStatistics, make_store
from rechunk_p2p.buffers.disk import DiskShardStore
from rechunk_p2p.buffers.memory import MemoryShardStore

__all__ = [
    "DiskShardStore",
    "MemoryShardStore",
    "Shard",
    "ShardStore",
    "StoreStatistics",
    "make_store",
]
