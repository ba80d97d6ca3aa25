"""Figures of one benchmark run beyond wall time and memory: where the CPU went (the
scheduler's loop thread, the workers' task threads and the rest of each worker), and when
the first transfer started and the last output finished.

Where it runs: the benchmark (client) process. The scheduler of a ``LocalCluster`` runs in
this process, on the loop thread (the client's own work there during a run is small); the
workers are read through ``client.run`` (their fine performance metrics) and the
scheduler's task stream.
"""

from __future__ import annotations

import threading
from typing import Any

import psutil
from distributed import Client


def scheduler_thread(client: Client) -> int | None:
    """The native id of the scheduler's loop thread, when the scheduler runs in this
    process (a ``LocalCluster``); else ``None``."""
    import os

    pid = client.run_on_scheduler(os.getpid)
    if pid != os.getpid():
        return None
    return client.run_on_scheduler(threading.get_native_id)


def thread_cpu_seconds(tid: int | None) -> float | None:
    """CPU seconds (user + system) of thread ``tid`` of this process so far."""
    if tid is None:
        return None
    for thread in psutil.Process().threads():
        if thread.id == tid:
            return thread.user_time + thread.system_time
    return None


def task_cpu_seconds(client: Client) -> dict[str, float]:
    """Per worker, the CPU seconds its task threads spent running tasks so far (distributed's
    ``execute ... thread-cpu`` metric)."""

    def read(dask_worker: Any) -> float:
        return sum(
            v
            for k, v in dask_worker.digests_total.items()
            if isinstance(k, tuple) and k[0] == "execute" and k[-2:] == ("thread-cpu", "seconds")
        )

    return client.run(read)


def stream_cursor(client: Client) -> int:
    """The scheduler's task stream position now (recording from here on if it was not)."""
    return client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.get_task_stream_index())


def stream_times(
    client: Client, cursor: int, since: float, output_name: str
) -> dict[str, float | None]:
    """From the tasks the scheduler's stream recorded after ``cursor``: seconds from
    ``since`` (wall clock) to the first transfer task's start, and from the last barrier's
    end to the last output task's end (``None`` where the stream holds no such task)."""

    def records(dask_scheduler: Any) -> list:
        return dask_scheduler.get_task_stream(start_index=cursor)

    first_transfer = last_barrier = last_output = None
    for record in client.run_on_scheduler(records):
        key = record["key"]
        name = key[0] if isinstance(key, tuple) else str(key)
        compute = [s for s in record.get("startstops", ()) if s["action"] == "compute"]
        if not compute:
            continue
        start, stop = min(s["start"] for s in compute), max(s["stop"] for s in compute)
        if "transfer" in name:
            first_transfer = start if first_transfer is None else min(first_transfer, start)
        elif "barrier" in name:
            last_barrier = stop if last_barrier is None else max(last_barrier, stop)
        elif name == output_name:
            last_output = stop if last_output is None else max(last_output, stop)
    return {
        "to_first_transfer_s": None if first_transfer is None else first_transfer - since,
        "barrier_to_last_output_s": (
            None if last_barrier is None or last_output is None else last_output - last_barrier
        ),
    }
