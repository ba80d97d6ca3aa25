"""Reaching the cluster from the client: plugin registration and engine statistics.

Where it runs: the client (the caller's thread); ``cluster_statistics`` runs one small
function on each worker through ``client.run``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rechunk_p2p.errors import ClusterError


def default_client() -> Any:
    """The current distributed client, or ``None`` (no client, or distributed not installed)."""
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


def current_n_workers() -> int:
    """Workers of the current (synchronous) client; 1 without one."""
    client = default_client()
    if client is None or client.asynchronous:
        return 1
    try:
        return max(len(client.scheduler_info(n_workers=-1)["workers"]), 1)
    except Exception:
        return 1


def ensure_registered() -> None:
    """Register the plugins on the current synchronous client's cluster, if there is one."""
    client = default_client()
    if client is not None and not client.asynchronous:
        register(client)


_registered: set[str] = set()
_registering = threading.Lock()  # one registration at a time: a second caller waits for it


def register(client: Any) -> Any:
    """Register rechunk_p2p's scheduler and worker plugins on ``client``'s cluster.

    Idempotent; workers that join later get the worker plugin too. :func:`rechunk` calls it
    for the default client. For an asynchronous client, await the result.

    Raises
    ------
    ClusterError
        The scheduler cannot be reached.
    """
    from rechunk_p2p.scheduler import RechunkSchedulerPlugin

    key = f"{client.id}@{client.scheduler.address}"
    if client.asynchronous:
        return _register_plugin(client, RechunkSchedulerPlugin())
    with _registering:
        if key not in _registered:
            _register_plugin(client, RechunkSchedulerPlugin())
            _registered.add(key)
    return None


def _register_plugin(client: Any, plugin: Any) -> Any:
    try:
        return client.register_plugin(plugin)
    except OSError as e:
        raise ClusterError(f"Cannot reach the scheduler at {client.scheduler.address}: {e}") from e


def register_in_background(client: Any) -> threading.Thread:
    """Start registering on ``client``'s (synchronous) cluster in a thread, for a caller that
    has other work before its first rechunk: the workers set up the engine (importing it and
    zarr, 0.4 s a worker at a command's start) while the caller goes on. A failure is left
    for the next :func:`register` call to raise."""

    def run() -> None:
        with contextlib.suppress(Exception):
            register(client)

    thread = threading.Thread(target=run, name="rechunk_p2p-register", daemon=True)
    thread.start()
    return thread


STATISTICS = ("runs", "bytes_sent", "bytes_received", "bytes_spilled", "messages_sent")
PHASES = ("cut", "queue_wait", "send", "store", "assemble")


def cluster_statistics(client: Any) -> dict[str, float]:
    """Totals over every worker since it started.

    ``runs``, ``bytes_sent``, ``bytes_received``, ``bytes_spilled``, ``messages_sent``
    (integers: batches of pieces sent to other workers, one message each), and the
    seconds spent in each phase, summed over workers and threads: ``seconds_cut``,
    ``seconds_queue_wait``, ``seconds_send``, ``seconds_store``, ``seconds_assemble``
    (see :class:`rechunk_p2p.worker.run.PhaseSeconds`).
    """

    def _totals(dask_worker: Any) -> dict[str, float]:  # runs on each worker
        from rechunk_p2p.worker.plugin import get_plugin

        try:
            totals = get_plugin(dask_worker).totals()
        except ClusterError:
            return {}
        values: dict[str, float] = {k: getattr(totals, k) for k in STATISTICS}
        values.update({f"seconds_{p}": getattr(totals.phases, p) for p in PHASES})
        return values

    per_worker = client.run(_totals)
    keys = (*STATISTICS, *(f"seconds_{p}" for p in PHASES))
    return {k: sum(t.get(k, 0) for t in per_worker.values()) for k in keys}
