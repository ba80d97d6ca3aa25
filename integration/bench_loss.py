"""An output owner killed mid-run: what continuing the run saves over a restart.

Where it runs: the benchmark process (client, and the scheduler of each local cluster, which
runs in this process) drives one fresh cluster per run and kills one worker process.

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.bench_loss --size 768MiB --repeat 3

Each run: 3 worker processes x 1 thread with nannies, every setting at its default; a 2-D
float64 array of row blocks generated on the workers, rechunked by ``rechunk_p2p`` to column
blocks of about 16 MiB, and every output chunk checked on the workers. Once the barrier has
passed and about half the outputs are finished (``--phase transfer``: half the transfers,
before the barrier), the worker process that owns the last block of outputs is killed
(``SIGKILL``). Two variants alternate:

- ``continue``: the engine as it is (the run continues without the worker);
- ``restart``: the same, with the scheduler plugin told never to continue (``_can_continue``
  replaced in this process), which restarts the run as before continuations existed.

Reported per variant (medians): seconds from the kill to the result, output chunks assembled
after the kill, transfer tasks run after the kill, and shard bytes the surviving workers sent
after the kill. A wrong result fails the benchmark (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dask.utils import format_bytes, parse_bytes
from distributed import Client, LocalCluster, SchedulerPlugin, WorkerPlugin

from integration.workloads import checked, rows_to_columns, source_array

VARIANTS = ("continue", "restart")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m integration.bench_loss", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size", default="768MiB", help="bytes of the array (default 768MiB)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--phase",
        choices=("unpack", "transfer"),
        default="unpack",
        help="kill half way through the unpacks (default) or the transfers",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    return p.parse_args(argv)


def _never_continue(dask_scheduler: Any) -> None:  # runs on the scheduler
    plugin = dask_scheduler.plugins["rechunk-p2p"]
    plugin._can_continue = lambda *args: False


def _progress(dask_scheduler: Any) -> dict:  # runs on the scheduler
    plugin = dask_scheduler.plugins.get("rechunk-p2p")
    runs = list(plugin.active.values()) if plugin is not None else []
    if not runs:
        return {}
    spec = runs[0].run_spec
    tasks = dask_scheduler.tasks
    barrier = tasks.get(f"rechunk_p2p-barrier-{spec.shuffle_id}")
    outputs = [spec.spec.output_key(flat) for flat in spec.spec.outputs]
    pending = {"waiting", "queued", "no-worker", "processing"}
    done = sum(1 for k in outputs if k not in tasks or tasks[k].state not in pending)
    last = spec.worker_for(spec.spec.outputs[-1])
    deps = barrier.dependencies if barrier is not None else ()
    return {
        "barrier": barrier.state if barrier is not None else None,
        "done": done,
        "outputs": len(outputs),
        "transfers_done": sum(1 for dt in deps if dt.state == "memory"),
        "inputs": len(spec.spec.inputs),
        "victim": last,
    }


def _reached(phase: str, progress: dict) -> bool:
    """Whether the run is half way through ``phase``."""
    if phase == "unpack":
        return progress.get("barrier") == "memory" and progress["done"] >= progress["outputs"] // 2
    return (
        progress.get("barrier") == "waiting"
        and progress["transfers_done"] >= progress["inputs"] // 2
    )


class ComputedCounter(SchedulerPlugin):
    """Counts the output and transfer tasks the scheduler sees finish after :attr:`since`."""

    name = "bench-loss-counter"

    def __init__(self) -> None:
        self.since = float("inf")
        self.counts = {"outputs": 0, "transfers": 0}

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish != "memory" or time.time() < self.since:
            return
        name = key[0] if isinstance(key, tuple) else str(key)
        if name.startswith("rechunk-p2p-out-"):
            self.counts["outputs"] += 1
        elif "rechunk_p2p-transfer-" in name:
            self.counts["transfers"] += 1


class Killer(SchedulerPlugin):
    """Kills the victim's process from the scheduler's own transition, once armed and the
    run is half way through the phase: a kill sent from the client after it saw the run get
    there came several round trips late, and with fast unpacks every output could be done
    by then (the lost results are then recomputed by a new run, not a continuation)."""

    name = "bench-loss-killer"

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.scheduler: Any = None
        self.pid: int | None = None
        self.killed_at: float | None = None
        self.progress: dict = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "memory":
            self.kill_if_due()

    def kill_if_due(self) -> None:
        if self.pid is None or self.killed_at is not None:
            return
        progress = _progress(self.scheduler)
        if progress and _reached(self.phase, progress):
            self.progress = progress
            self.killed_at = time.time()
            self.scheduler.plugins[ComputedCounter.name].since = self.killed_at
            os.kill(self.pid, signal.SIGKILL)


class FirstUnpack(WorkerPlugin):
    """Notes, on each worker, the shard bytes it had sent when its first output task began:
    after the barrier, so every transfer's bytes, and before the kill, which comes half way
    through the outputs (checked against the kill's time)."""

    name = "bench-loss-first-unpack"

    def __init__(self) -> None:
        self.sent: int | None = None
        self.at: float | None = None
        self.worker: Any = None

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        name = key[0] if isinstance(key, tuple) else str(key)
        if self.sent is None and finish == "executing" and name.startswith("rechunk-p2p-out-"):
            self.sent = self.worker.plugins["rechunk-p2p"].totals().bytes_sent
            self.at = time.time()


def _first_unpack(dask_worker: Any) -> tuple[int | None, float | None]:
    plugin = dask_worker.plugins[FirstUnpack.name]
    return plugin.sent, plugin.at


def _arm(dask_scheduler: Any, pid: int) -> None:  # runs on the scheduler
    killer = dask_scheduler.plugins[Killer.name]
    killer.pid = pid
    killer.kill_if_due()


def _killed(dask_scheduler: Any) -> tuple[float | None, dict]:  # runs on the scheduler
    killer = dask_scheduler.plugins[Killer.name]
    return killer.killed_at, killer.progress


def _after(dask_scheduler: Any) -> dict:  # runs on the scheduler
    """Tasks computed since the kill, by kind, and the engine plugin's counters."""
    counts = dict(dask_scheduler.plugins[ComputedCounter.name].counts)
    plugin = dask_scheduler.plugins["rechunk-p2p"]
    counts.update(
        continuations=plugin.continuations, restarts=plugin.restarts, runs=plugin.runs_created
    )
    return counts


def _bytes_sent(client: Client, workers: list[str]) -> int:
    def sent(dask_worker: Any) -> int:
        return dask_worker.plugins["rechunk-p2p"].totals().bytes_sent

    return sum(client.run(sent, workers=workers).values())


def one_run(variant: str, phase: str, nbytes: int, timeout: float) -> dict:
    import rechunk_p2p

    w = rows_to_columns(nbytes)
    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(3, timeout=120)
        rechunk_p2p.register(client)
        client.register_plugin(ComputedCounter())
        client.register_plugin(Killer(phase))
        client.register_plugin(FirstUnpack())
        if variant == "restart":
            client.run_on_scheduler(_never_continue)
        future = client.compute(checked(rechunk_p2p.rechunk(source_array(w), w.target_chunks), w))
        deadline = time.monotonic() + timeout

        def wait_for(what: str, done: Any) -> dict:
            while True:
                progress = client.run_on_scheduler(_progress)
                if progress and done(progress):
                    return progress
                if time.monotonic() > deadline or future.done():
                    raise RuntimeError(f"never reached {what}: {progress}")
                time.sleep(0.005)

        progress = wait_for("the run", lambda p: True)
        victim = progress["victim"]
        survivors = [a for a in client.scheduler_info()["workers"] if a != victim]
        if phase == "transfer":  # as late as the client can take it, then the kill
            sent_before = _bytes_sent(client, survivors)
        pid = client.run(os.getpid, workers=[victim])[victim]
        # armed before the barrier: the scheduler kills the victim in the transition that
        # brings the run half way through the phase (a kill from the client came several
        # round trips late, and the outputs were sometimes all done by then)
        client.run_on_scheduler(_arm, pid=pid)
        while (killed := client.run_on_scheduler(_killed))[0] is None:
            if time.monotonic() > deadline or future.done():
                raise RuntimeError(f"never reached the {phase} phase to kill {victim}")
            time.sleep(0.005)
        killed_at, progress = killed
        ok = bool(future.result(timeout=max(deadline - time.monotonic(), 1)))
        seconds = time.time() - killed_at
        after = client.run_on_scheduler(_after)
        sent_after = _bytes_sent(client, survivors)
        if phase == "unpack":  # nothing is sent from the barrier until the kill
            firsts = client.run(_first_unpack, workers=survivors).values()
            if any(sent is None or at >= killed_at for sent, at in firsts):
                raise RuntimeError(f"a survivor began no output before the kill: {firsts}")
            sent_before = sum(sent for sent, _ in firsts)
    return {
        "variant": variant,
        "phase": phase,
        "ok": ok,
        "seconds_after_kill": round(seconds, 3),
        "outputs_total": progress["outputs"],
        "outputs_done_at_kill": progress["done"],
        "transfers_done_at_kill": progress["transfers_done"],
        "outputs_after_kill": after["outputs"],
        "transfers_after_kill": after["transfers"],
        "bytes_sent_after_kill": sent_after - sent_before,
        "continuations": after["continuations"],
        "restarts": after["restarts"],
        "runs": after["runs"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nbytes = int(parse_bytes(args.size))
    w = rows_to_columns(nbytes)
    when = "after the barrier" if args.phase == "unpack" else "during the transfers"
    print(f"# {w.summary()}, 3 workers x 1 thread; owner killed {when}", flush=True)
    runs = []
    for _ in range(args.repeat):
        for variant in VARIANTS:
            run = one_run(variant, args.phase, nbytes, args.timeout)
            runs.append(run)
            print(json.dumps(run), flush=True)
    print("\n| variant | s after kill | outputs assembled after | transfers after | "
          "shard bytes sent after |")
    print("|---|---:|---:|---:|---:|")
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]

        def med(key: str, mine: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        print(
            f"| {variant} | {med('seconds_after_kill'):.2f} | {med('outputs_after_kill'):.0f}"
            f" of {mine[0]['outputs_total']} | {med('transfers_after_kill'):.0f} | "
            f"{format_bytes(med('bytes_sent_after_kill'))} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
