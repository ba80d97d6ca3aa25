"""CPU time of each process around one persisted rechunk: where a run's cores went.

Run from the repository root::

    PYTHONPATH=. python -m integration.cpu_times --workload 2d128 --impl rechunk_p2p --runs 3

Each run starts a fresh ``LocalCluster`` (2 worker processes x 1 thread, default settings),
builds the workload's graph, and reads user and system CPU seconds of both workers and of
this process (which runs the scheduler and the client) right before and after persisting
the rechunked array. The outputs are checked afterwards, outside the measurement. Runs follow
each other without a pause, so the first one meets memory the machine has not used for a
while (on a VM whose balloon reports free pages, a first touch of such memory costs more).
"""

from __future__ import annotations

import argparse
import os
import time

import psutil
from distributed import Client, LocalCluster, wait

from integration.workloads import (
    IMPLEMENTATIONS,
    checked,
    many_small,
    rows_to_columns,
    rows_to_columns_8mib,
    time_to_space,
    workload_graph,
)

WORKLOADS = {
    "2d": rows_to_columns,
    "2d128": rows_to_columns_8mib,
    "3d": time_to_space,
    "many": many_small,
}


def measure(workload: str, impl: str, nbytes: int) -> dict[str, float]:
    """Wall seconds and per-process user/system CPU seconds of one persisted rechunk."""
    w = WORKLOADS[workload](nbytes)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        pids = client.run(os.getpid)
        procs = {f"worker{i}": psutil.Process(p) for i, p in enumerate(pids.values())}
        procs["scheduler+client"] = psutil.Process()
        y, _ = workload_graph(impl, w)
        before = {k: p.cpu_times() for k, p in procs.items()}
        start = time.perf_counter()
        held = client.persist(y)
        wait(held)
        out = {"wall": time.perf_counter() - start}
        for k, p in procs.items():
            now = p.cpu_times()
            out[f"{k} user"] = now.user - before[k].user
            out[f"{k} sys"] = now.system - before[k].system
        if not client.compute(checked(held, w)).result():
            raise AssertionError(f"{impl} produced wrong outputs on {w.name}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="2d128")
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, default="rechunk_p2p")
    parser.add_argument("--size", default="1GiB", help="bytes of the array")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    from dask.utils import parse_bytes

    for n in range(args.runs):
        r = measure(args.workload, args.impl, parse_bytes(args.size))
        cpu = "  ".join(
            f"{k} {r[k + ' user']:.2f} + {r[k + ' sys']:.2f}"
            for k in ("worker0", "worker1", "scheduler+client")
        )
        print(f"[{n}] {args.workload} {args.impl} wall {r['wall']:.2f} s  cpu user + sys s: {cpu}")


if __name__ == "__main__":
    main()
