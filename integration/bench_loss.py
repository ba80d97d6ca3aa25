"""An output owner killed mid-run: what continuing the run saves over a restart.

Where it runs: the benchmark process (client, and the scheduler of each local cluster, which
runs in this process) drives one fresh cluster per run; one worker process kills itself.

Usage::

    PYTHONPATH=. .venv/bin/python -m integration.bench_loss --size 768MiB --repeat 3

Each run: 3 worker processes x 1 thread with nannies, every setting at its default; a 2-D
float64 array of row blocks generated on the workers, rechunked by ``rechunk_p2p`` to column
blocks of about 16 MiB, and every output chunk checked on the workers. The worker process that
owns the last block of outputs is killed (``SIGKILL``, sent by itself from a worker plugin of
the benchmark) as it begins the second half of its own outputs (``--phase transfer``: the
second half of its share of the transfers, before the barrier).
Two variants alternate:

- ``continue``: the engine as it is (the run continues without the worker);
- ``restart``: the same, with the scheduler plugin told never to continue a run whose owner
  left (its decision replaced in the scheduler's process), which restarts the run as before
  continuations existed.

Reported per variant (medians): seconds from the kill to the result, output chunks assembled
after the kill, transfer tasks run after the kill, and piece bytes the surviving workers sent
after the kill. A wrong result fails the benchmark (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
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
    from rechunk_p2p import recovery, scheduler_recovery

    def restart_instead(run: Any, worker: str, facts: Any, run_id: Any) -> Any:
        if worker in run.owners:
            return recovery.Restart(f"worker {worker} left")
        return recovery.worker_left(run, worker, facts, run_id)

    scheduler_recovery.worker_left = restart_instead  # type: ignore[assignment]


def _victim(dask_scheduler: Any) -> dict:  # runs on the scheduler
    """The owner of the run's last output and its number of outputs, once there is a run."""
    plugin = dask_scheduler.plugins.get("rechunk-p2p")
    runs = list(plugin.active.values()) if plugin is not None else []
    if not runs:
        return {}
    spec = runs[0].run_spec
    victim = spec.worker_for(spec.spec.outputs[-1])
    mine = sum(spec.worker_for(flat) == victim for flat in spec.spec.outputs)
    return {"victim": victim, "outputs": len(spec.spec.outputs), "victim_outputs": mine}


def _output(key: Any) -> bool:
    return isinstance(key, tuple) and key[0].startswith("rechunk-p2p-out-")


def _transfer(key: Any) -> bool:
    return isinstance(key, tuple) and "rechunk_p2p-transfer-" in key[0]


class ComputedCounter(SchedulerPlugin):
    """Notes when the scheduler sees each output and transfer task finish."""

    name = "bench-loss-counter"

    def __init__(self) -> None:
        self.finished: list[tuple[float, str, Any]] = []

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "memory" and (_output(key) or _transfer(key)):
            self.finished.append((time.time(), "outputs" if _output(key) else "transfers", key))


class OwnKill(WorkerPlugin):
    """Kills its own worker process (``SIGKILL``) on the victim, the owner of the run's last
    output, half way through the phase: as it begins the output task after the first half of
    its own outputs (the unpacks), or the transfer task after half of an even share of the
    inputs (the transfers). The time of the kill goes to a file first; a file already there
    means the kill was done (by the victim's process, or a worker that replaced it).

    The kill comes from the victim itself: assembled in memory as the pieces came, outputs take
    no time, and a kill from the scheduler as it saw half of them finished came after the
    victim had finished the others too (then only results are lost, and recomputed by a new
    run, not a continuation)."""

    name = "bench-loss-own-kill"

    def __init__(self, phase: str, path: str) -> None:
        self.phase = phase
        self.path = path
        self.begun = 0
        self.worker: Any = None

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish != "executing":
            return
        if not (_output(key) if self.phase == "unpack" else _transfer(key)):
            return
        self.begun += 1
        runs = list(self.worker.plugins["rechunk-p2p"].runs.values())
        if not runs or Path(self.path).exists():  # a transfer may come before the run
            return
        spec = runs[0].run_spec
        if spec.worker_for(spec.spec.outputs[-1]) != self.worker.address:
            return
        if self.phase == "unpack":
            mine = sum(spec.worker_for(flat) == self.worker.address for flat in spec.spec.outputs)
        else:
            mine = len(spec.spec.inputs) // len(spec.workers)
        if self.begun > mine // 2:
            Path(self.path).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class FirstUnpack(WorkerPlugin):
    """Notes, on each worker, the piece bytes it had sent when it was first given an output
    task. That is after the barrier, which flushed every send: every transfer's bytes. And it
    is before any byte of a continuation: the scheduler gave the output tasks before it heard
    of the kill, on the stream that then tells of the continuation."""

    name = "bench-loss-first-unpack"

    def __init__(self) -> None:
        self.sent: int | None = None
        self.worker: Any = None

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if self.sent is None and _output(key):
            self.sent = self.worker.plugins["rechunk-p2p"].totals().bytes_sent


def _first_unpack(dask_worker: Any) -> int | None:
    return dask_worker.plugins[FirstUnpack.name].sent


def _after(dask_scheduler: Any, killed_at: float) -> dict:  # runs on the scheduler
    """Output and transfer tasks finished before and after the kill, and the engine plugin's
    counters."""
    counts = {"outputs": 0, "transfers": 0, "outputs_before": set(), "transfers_before": set()}
    for at, kind, key in dask_scheduler.plugins[ComputedCounter.name].finished:
        if at >= killed_at:
            counts[kind] += 1
        else:
            counts[f"{kind}_before"].add(key)
    counts["outputs_before"] = len(counts["outputs_before"])
    counts["transfers_before"] = len(counts["transfers_before"])
    plugin = dask_scheduler.plugins["rechunk-p2p"]
    counts.update(
        continuations=plugin.recovery.counts.continuations,
        restarts=plugin.recovery.counts.restarts,
        runs=plugin.runs_created,
    )
    return counts


def _bytes_sent(client: Client, workers: list[str]) -> int:
    def sent(dask_worker: Any) -> int:
        return dask_worker.plugins["rechunk-p2p"].totals().bytes_sent

    return sum(client.run(sent, workers=workers).values())


def one_run(variant: str, phase: str, nbytes: int, timeout: float, scratch: Path) -> dict:
    import rechunk_p2p

    w = rows_to_columns(nbytes)
    x = rechunk_p2p.rechunk(source_array(w), w.target_chunks)
    killed = scratch / f"killed-{variant}"
    killed.unlink(missing_ok=True)
    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(3, timeout=120)
        rechunk_p2p.register(client)
        client.register_plugin(ComputedCounter())
        client.register_plugin(OwnKill(phase, str(killed)))
        client.register_plugin(FirstUnpack())
        if variant == "restart":
            client.run_on_scheduler(_never_continue)
        future = client.compute(checked(x, w))
        deadline = time.monotonic() + timeout
        while not (run := client.run_on_scheduler(_victim)):
            if time.monotonic() > deadline or future.done():
                raise RuntimeError("never saw the run")
            time.sleep(0.005)
        victim = run["victim"]
        survivors = [a for a in client.scheduler_info()["workers"] if a != victim]
        if phase == "transfer":  # as late as the client can take it (checked below)
            sent_before, read_at = _bytes_sent(client, survivors), time.time()
        ok = bool(future.result(timeout=max(deadline - time.monotonic(), 1)))
        if not killed.exists():
            raise RuntimeError(f"{victim} was never killed: the run finished first")
        killed_at = float(killed.read_text())
        seconds = time.time() - killed_at
        after = client.run_on_scheduler(_after, killed_at=killed_at)
        sent_after = _bytes_sent(client, survivors)
        if phase == "transfer" and read_at >= killed_at:
            raise RuntimeError("the victim was killed before the survivors' bytes were read")
        if phase == "unpack":  # nothing is sent from the barrier until the kill
            firsts = client.run(_first_unpack, workers=survivors).values()
            if None in firsts:
                raise RuntimeError(f"a survivor was given no output task: {firsts}")
            sent_before = sum(firsts)
    return {
        "variant": variant,
        "phase": phase,
        "ok": ok,
        "seconds_after_kill": round(seconds, 3),
        "outputs_total": run["outputs"],
        "outputs_done_at_kill": after["outputs_before"],
        "victim_outputs": run["victim_outputs"],
        "transfers_done_at_kill": after["transfers_before"],
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
    with tempfile.TemporaryDirectory(prefix="bench-loss-") as scratch:
        for _ in range(args.repeat):
            for variant in VARIANTS:
                run = one_run(variant, args.phase, nbytes, args.timeout, Path(scratch))
                runs.append(run)
                print(json.dumps(run), flush=True)
    print(
        "\n| variant | s after kill | outputs assembled after | transfers after | "
        "piece bytes sent after |"
    )
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
