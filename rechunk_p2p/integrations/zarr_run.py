"""Running a zarr rechunk's write tasks on a cluster, and stopping them cleanly.

Where it runs: the client (the caller's thread), blocking until the cluster is done, or
until every write task it started has stopped after a failure or an interrupt.

Cancelling a task does not stop a thread that is writing a chunk: the worker finishes it.
So after a failure or an interrupt the client waits until no write task runs on any worker
(:func:`wait_for_writers`) before it decides what becomes of the target: removed if a task
raised (a resume would fail the same way), else kept as an unfinished run that ``resume``
continues (Ctrl-C, SIGTERM, a lost cluster).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import dask.array as da
import distributed
from dask.highlevelgraph import HighLevelGraph

from rechunk_p2p.errors import ClusterError
from rechunk_p2p.integrations.zarr_writes import WRITE_PREFIX

logger = logging.getLogger(__name__)

#: How long a stopped run waits for chunk writes in progress to end.
WRITES_END_SECONDS = 120.0


def optimized_writes(graph: Any, keys: list[Any]) -> tuple[HighLevelGraph, list[Any]]:
    """The write tasks ``keys`` of ``graph``, culled and optimized as dask would, as one
    layer of a unique name: distributed names a plain graph by tokenizing every task (each
    carries the zarr target: 0.27 s for 256 chunks), a layered one by its layers' names."""
    optimized = da.Array.__dask_optimize__(graph, keys) if keys else {}
    layer = f"{WRITE_PREFIX}-run-{uuid.uuid4().hex}"
    return HighLevelGraph({layer: dict(optimized)}, {layer: set()}), keys


def run_writes(
    client: distributed.Client,
    graph: Any,
    keys: list[Any],
    *,
    progress: bool,
    on_task_error: Callable[[], None],
) -> None:
    """Run the tasks ``keys`` of ``graph`` to the end on ``client``'s cluster.

    Whatever stops the run, it raises only once every write task has stopped (as far as the
    cluster can still be asked); if a task raised, ``on_task_error()`` is called first, and
    the task's error is raised.
    """
    if not keys:
        return
    futures = client.get(graph, keys, sync=False)
    try:
        _wait(futures, progress)
    except BaseException:
        failed = any(f.status == "error" for f in futures)  # before cancelling them
        _cancel_and_wait(client, futures)
        if failed:
            on_task_error()
        raise
    finally:
        with contextlib.suppress(Exception):
            client.cancel(futures)  # release the flags the tasks returned


def _wait(futures: list[distributed.Future], progress: bool) -> None:
    if progress and sys.stderr.isatty():
        # distributed's text bar writes to stdout; animate it on the terminal's stderr,
        # and not at all into a log or a pipe (it would write thousands of updates)
        with contextlib.redirect_stdout(sys.stderr):
            distributed.progress(futures, notebook=False)
    for future in distributed.as_completed(futures):  # stops at the first error
        if future.status != "finished":
            future.result()  # raises the task's error, or why it was cancelled


def _cancel_and_wait(client: distributed.Client, futures: list[distributed.Future]) -> None:
    """Cancel what is left of the run and wait for the writes in progress to end; a
    second interrupt stops the waiting."""
    try:
        client.cancel(futures)
        wait_for_writers(client)
    except KeyboardInterrupt:
        logger.warning("stopped waiting for chunk writes in progress")
    except Exception as e:  # the cluster is gone: nothing is writing
        logger.debug("cannot reach the cluster after a stopped run: %s", e)


def wait_for_writers(client: distributed.Client, timeout: float = WRITES_END_SECONDS) -> None:
    """Block until no worker runs a write task (or ``timeout`` seconds passed).

    Raises
    ------
    ClusterError
        Writes were still running after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        busy = client.run(_writes_in_progress, on_error="return")
        if not sum(n for n in busy.values() if isinstance(n, int)):
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"chunk writes of an earlier run still running after {timeout:.0f} s: {busy}"
            )
        time.sleep(0.05)


def _writes_in_progress(dask_worker: distributed.Worker) -> int:
    """On a worker: the write tasks still running there, cancelled ones included."""
    running = ("executing", "long-running", "cancelled", "resumed")
    return sum(
        1
        for ts in list(dask_worker.state.tasks.values())
        if ts.state in running and WRITE_PREFIX in str(ts.key)
    )
