"""A worker-side seam: fake scheduler, data planes and workers around real worker plugins.

The plugins, runs, comm buffers and piece stores under test are the real ones; what they talk
to is in-process and scripted, so races (a close overtaking a reply, a send failing, a batch
delivered twice) happen in the order a test chooses, on one event loop. Task-thread entry
points (``*_blocking``) are called from threads with ``asyncio.to_thread``, as a worker's task
threads would call them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from distributed.core import error_message

from rechunk_p2p.offload import OffloadPool
from rechunk_p2p.planning import make_partials
from rechunk_p2p.spec import RunId, RunSpec, ShuffleId, ShuffleSpec
from rechunk_p2p.transport.limiter import ByteLimiter
from rechunk_p2p.transport.wire import Packed
from rechunk_p2p.worker.plugin import RechunkWorkerPlugin

SHUFFLE = ShuffleId("seam-0.0")


def make_run_spec(
    workers: tuple[str, ...],
    run_id: int = 1,
    storage: str = "memory",
    rows: int = 8,
    columns: int = 4,
) -> RunSpec:
    """A run of a ``rows x 12`` float64 array: one row per input chunk -> ``columns`` column
    blocks; worker ``w``'s data plane is ``"dp-" + w``."""
    (partial,) = make_partials(((1,) * rows, (12,)), ((rows,), (12 // columns,) * columns))
    spec = ShuffleSpec(
        shuffle_id=SHUFFLE,
        partial=partial,
        dtype=np.dtype("f8"),
        storage=storage,  # type: ignore[arg-type]
        output_name="out",
    )
    return RunSpec(
        spec=spec,
        run_id=RunId(run_id),
        workers=workers,
        dataplanes=tuple(f"dp-{w}" for w in workers),
        shift=0,
    )


def input_chunk(flat: int) -> np.ndarray:
    """Row ``flat`` of the array the seam rechunks (every element unique)."""
    return np.arange(flat * 12, flat * 12 + 12, dtype="f8").reshape(1, 12)


@dataclass
class Network:
    """Delivers batches between fake data planes, by data plane address.

    ``fail`` is called before each delivery with ``(sender, address, attempt)`` and may raise
    (an ``OSError`` is a transient comm error); ``copies`` delivers each batch that many times;
    ``misroute`` sends what is addressed to one data plane to another; while ``hold`` is
    clear, deliveries wait (sends stay in flight).
    """

    planes: dict[str, RechunkWorkerPlugin] = field(default_factory=dict)
    fail: Callable[[str, str, int], None] | None = None
    copies: int = 1
    attempts: Counter = field(default_factory=Counter)
    misroute: dict[str, str] = field(default_factory=dict)
    hold: asyncio.Event | None = None

    async def deliver(
        self, sender: str, address: str, shuffle_id: ShuffleId, run_id: RunId, batch: list
    ) -> None:
        self.attempts[sender, address] += 1
        if self.hold is not None:
            await self.hold.wait()
        if self.fail is not None:
            self.fail(sender, address, self.attempts[sender, address])
        peer = self.planes[self.misroute.get(address, address)]
        for _ in range(self.copies):
            # as over the wire: the receiver gets bytes of its own, never the sender's
            arrived = [Packed.from_message(p.header(), p.payload.copy()) for p in batch]
            await peer.receive(shuffle_id, run_id, arrived)


class FakeDataPlane:
    """**Loop-confined** (the test's loop). What a run needs of a data plane."""

    def __init__(self, address: str, network: Network, buffer_bytes: int = 2**30) -> None:
        self.address = f"dp-{address}"
        self.loop = asyncio.get_running_loop()
        self.limiter = ByteLimiter(buffer_bytes)
        self.send_slots = asyncio.Semaphore(4)
        self._network = network
        self._worker = address

    async def send(self, address: str, shuffle_id: ShuffleId, run_id: RunId, batch: list) -> None:
        await self._network.deliver(self._worker, address, shuffle_id, run_id, batch)


class FakeScheduler:
    """The scheduler plugin's RPCs, answered from one scripted run per shuffle.

    ``gate`` (when set) holds every ``get_or_create`` reply until the test sets it.
    """

    def __init__(self, run_spec: RunSpec) -> None:
        self.run_spec = run_spec
        self.plugins: dict[str, RechunkWorkerPlugin] = {}
        self.gate: asyncio.Event | None = None
        self.restricted: list[tuple[Any, str]] = []
        self.restarts: list[tuple[RunId, str]] = []
        self.lost: list[tuple[RunId, int | None, str | None]] = []  # (run, output, its worker)
        self.requests: Counter = Counter()

    async def rechunk_p2p_get_or_create(self, shuffle_id: ShuffleId, worker: str) -> dict:
        self.requests[worker] += 1
        if self.gate is not None:
            await self.gate.wait()
        return {"status": "OK", "run_spec": self.run_spec}

    async def rechunk_p2p_barrier(self, shuffle_id: ShuffleId, run_ids: list[RunId]) -> dict:
        current = self.run_spec.run_id
        if any(r != current for r in run_ids):
            return {"status": "OK", "restarted": True}
        for plugin in self.plugins.values():
            try:
                reply = await plugin._worker_barrier(shuffle_id, current)
            except Exception as e:
                return error_message(e)
            if reply["status"] == "error":
                return reply  # passed on unopened, as the scheduler plugin does
        return {"status": "OK", "run_id": current}

    async def rechunk_p2p_restart(
        self, shuffle_id, run_id, reason="", output=None, worker=None
    ) -> dict:
        self.restarts.append((run_id, reason))
        self.lost.append((run_id, output, worker))
        return {"status": "OK"}

    async def rechunk_p2p_restrict(self, shuffle_id, run_id, key, worker) -> dict:
        self.restricted.append((key.data, worker))  # sent wrapped in ToPickle
        return {"status": "OK"}

    def close(self, shuffle_id: ShuffleId, run_id: RunId) -> None:
        """The scheduler's close message, delivered to every worker (a stream message)."""
        for plugin in self.plugins.values():
            plugin._close_handler(shuffle_id, run_id, reason="closed by the test")


def fake_worker(
    address: str, scheduler: FakeScheduler, network: Network, local_directory: str
) -> RechunkWorkerPlugin:
    """A real plugin wired to fakes, as :meth:`RechunkWorkerPlugin.setup` would wire it."""
    plugin = RechunkWorkerPlugin()
    plugin.worker = SimpleNamespace(
        address=address,
        loop=SimpleNamespace(asyncio_loop=asyncio.get_running_loop()),
        scheduler=scheduler,
        local_directory=local_directory,
        memory_manager=SimpleNamespace(memory_limit=None),
        state=SimpleNamespace(tasks={}),  # (no task runs through distributed here)
        get_current_task=lambda: None,
    )
    plugin.offload = OffloadPool(2, name=f"seam-offload-{address}")
    plugin.dataplane = FakeDataPlane(address, network)  # type: ignore[assignment]
    plugin._ready.set()
    scheduler.plugins[address] = plugin
    network.planes[f"dp-{address}"] = plugin
    return plugin


async def close_all(plugins: list[RechunkWorkerPlugin]) -> None:
    """Close every run as the scheduler would (its close message, so late deliveries cannot
    reopen a run), then stop the pools."""
    for plugin in plugins:
        for run in list(plugin.runs.values()):
            plugin._close_handler(run.shuffle_id, run.run_id, reason="test over")
    for plugin in plugins:
        await asyncio.gather(*plugin._background, return_exceptions=True)
    for plugin in plugins:
        assert not plugin.runs, plugin.runs
        plugin.offload.shutdown()
