"""Installing rechunk_p2p on a cluster from a task, for clients that never registered it.

Where it runs: task threads (``plugin_for_task``), hopping once to the worker's event loop
to ask the scheduler to install its plugin (which installs the worker plugin everywhere).
"""

from __future__ import annotations

import asyncio
from typing import Any

from distributed.protocol.pickle import dumps

from rechunk_p2p.errors import ClusterError, StaleRunError
from rechunk_p2p.offload import from_thread
from rechunk_p2p.spec import PLUGIN_NAME
from rechunk_p2p.worker.plugin import INSTALL_TIMEOUT, RechunkWorkerPlugin, get_plugin
from rechunk_p2p.worker.scheduler_rpc import scheduler_rpc, worker_closing


def plugin_for_task(worker: Any) -> RechunkWorkerPlugin:
    """From a task thread: the plugin of ``worker``, installed on the cluster if missing.

    A rechunk computed by a client that never registered the plugins (an asynchronous client,
    a graph built elsewhere) installs them here, once per cluster: the scheduler plugin, which
    in turn registers this plugin on every current and future worker.
    """
    if PLUGIN_NAME not in worker.plugins:
        _raise_if_closing(worker)  # its plugins were taken down: nothing to install for
        from_thread(worker.loop.asyncio_loop, _install, worker)
    plugin = get_plugin(worker)
    plugin.wait_ready_blocking()
    return plugin


async def _install(worker: Any) -> None:
    """On the worker loop: register the scheduler plugin; wait for the worker plugin."""
    # the scheduler's code (five modules) only where a task installs it: a module imported
    # in a task thread during a rechunk is compiled there, holding the GIL (a worker loop's
    # worst stall at 32 workers when no bytecode is cached)
    from rechunk_p2p.scheduler import RechunkSchedulerPlugin

    loop = asyncio.get_running_loop()
    deadline = loop.time() + INSTALL_TIMEOUT
    try:
        await scheduler_rpc(
            worker,
            "register_scheduler_plugin",
            plugin=dumps(RechunkSchedulerPlugin()),
            name=PLUGIN_NAME,
            idempotent=True,
        )
    except Exception as e:
        raise ClusterError(
            f"Worker {worker.address} could not install rechunk_p2p on the scheduler ({e}); "
            "call rechunk_p2p.register(client) or start the scheduler with "
            "--preload rechunk_p2p"
        ) from e
    # another worker's request may still be registering the worker plugin everywhere
    while PLUGIN_NAME not in worker.plugins:
        _raise_if_closing(worker)
        if loop.time() > deadline:
            raise ClusterError(
                f"The rechunk_p2p worker plugin did not reach {worker.address} within "
                f"{INSTALL_TIMEOUT:g} s of installing it"
            )
        await asyncio.sleep(0.02)


def _raise_if_closing(worker: Any) -> None:
    if worker_closing(worker):
        raise StaleRunError(f"Worker {worker.address} is closing; its task is dropped")
