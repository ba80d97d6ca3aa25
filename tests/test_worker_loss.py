"""Worker loss for real: a worker process killed (SIGKILL) in each phase of a rechunk.

Where it runs: the pytest process, against a multi-process ``LocalCluster`` with nannies (a
killed worker is restarted by its nanny). The data is made and checked on the workers (every
element's value is a hash of its index, see :mod:`integration.workloads`), so a misplaced,
missing or duplicated element fails the check.

The default run kills once per phase; ``-m slow`` repeats every phase ten times.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait

import rechunk_p2p
from integration.workloads import checked, expected_block
from tests.conftest import assert_clean_sync
from tests.engine_helpers import PLUGIN

SHAPE = (1200, 1200)
DTYPE = "float64"
PHASES = ("transfer", "barrier", "unpack", "bystander")
#: Bound on one rechunk with one kill: the run restarts at most a few times.
TIMEOUT = 120
#: Input chunks of this many rows are joined, three to a transfer task (240 chunks, 80 tasks)
JOINED_ROWS = 5


def _slow_fill(shape, dtype, block_info=None):
    time.sleep(0.02)  # stretch the transfer phase so that a kill lands inside it
    return expected_block(shape, block_info[None]["array-location"], dtype)


def _slow_check_input(block):
    # stretch the unpack phase the same way: an unpack task only hands over an output the
    # memory store filled as pieces came, so without this the 24 outputs are done within
    # the ~0.1 s it takes to see the barrier finish and kill (and no run is left to continue)
    time.sleep(0.05)
    return block


@contextlib.contextmanager
def _cluster():
    """A fresh 3-worker cluster. The killed worker's nanny restarts it, but that restart
    sometimes never finishes on this machine (distributed's nanny, with or without the
    engine), so every kill gets a cluster of its own rather than waiting for it."""
    with (
        LocalCluster(
            n_workers=3,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            memory_limit="2GiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(3, timeout=120)
        yield client


def _fill(shape, dtype, block_info=None):
    return expected_block(shape, block_info[None]["array-location"], dtype)


def _source(seed: int, rows: int = 20, slow: bool = True) -> da.Array:
    """The input, each chunk made in 20 ms more (``slow``: a made input, so that the
    transfer phase lasts) or at once (an input persisted before the rechunk)."""
    chunks = da.core.normalize_chunks((rows, SHAPE[1]), SHAPE)
    fill = _slow_fill if slow else _fill
    return da.map_blocks(fill, SHAPE, DTYPE, dtype=DTYPE, chunks=chunks, name=f"source-{seed}")


def _scheduler_state(dask_scheduler) -> dict:
    plugin = dask_scheduler.plugins.get(PLUGIN)
    barriers = {
        key: ts.state
        for key, ts in dask_scheduler.tasks.items()
        if isinstance(key, str) and key.startswith("rechunk_p2p-barrier-")
    }
    runs = []
    for run in plugin.active.values() if plugin else ():
        spec = run.run_spec
        owners = {spec.worker_for(flat) for flat in spec.spec.outputs}
        runs.append({"workers": list(spec.workers), "owners": sorted(owners)})
    return {"barriers": barriers, "runs": runs}


def _pids(client) -> dict[str, int]:
    return client.run(os.getpid)


def _wait_for_phase(client, phase: str, deadline: float) -> str:
    """Wait until the rechunk is in ``phase``; the address of the worker to kill."""
    while time.monotonic() < deadline:
        state = client.run_on_scheduler(_scheduler_state)
        runs, barriers = state["runs"], state["barriers"]
        if runs:
            run = runs[0]
            owners = run["owners"]
            bystanders = [w for w in run["workers"] if w not in owners]
            barrier_states = set(barriers.values())
            if phase == "transfer" and barrier_states <= {"waiting", "queued", "no-worker"}:
                return owners[-1]
            if phase == "bystander" and bystanders:
                return bystanders[0]
            if phase == "barrier" and "processing" in barrier_states:
                return owners[0]
            if phase == "unpack" and "memory" in barrier_states:
                return owners[-1]
        time.sleep(0.005)
    raise AssertionError(f"the rechunk never reached phase {phase!r}")


def _counters(dask_scheduler) -> dict:
    plugin = dask_scheduler.plugins[PLUGIN]
    return {
        "runs": plugin.runs_created,
        "restarts": plugin.recovery.counts.restarts,
        "continuations": plugin.recovery.counts.continuations,
        "moved": plugin.recovery.counts.outputs_moved,
        "saved": plugin.recovery.counts.restarts_saved,
        "joined": plugin.recovery.counts.joined,
    }


def _gate_unpacks(gate: str) -> None:
    """In a worker process: the first unpack task runs (so that in the unpack phase some
    outputs are done before the kill, the victim's among them), every later one waits until
    the file ``gate`` exists (a race injected: the test creates it after the kill, so a kill
    seen in any phase lands in it, while the run is open, however long the test takes to
    see the phase on a loaded machine; unpacks alone take a few ms, and the run closes once
    the last one is done: a kill after that starts a new run)."""
    from rechunk_p2p.worker.plugin import RechunkWorkerPlugin

    unpack = getattr(RechunkWorkerPlugin.unpack_blocking, "ungated", None)
    unpack = unpack or RechunkWorkerPlugin.unpack_blocking
    started = []

    def gated_unpack(self, *args, **kwargs):
        if started:
            deadline = time.monotonic() + TIMEOUT
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        started.append(True)
        return unpack(self, *args, **kwargs)

    gated_unpack.ungated = unpack
    RechunkWorkerPlugin.unpack_blocking = gated_unpack


def _stretch_held_transfers() -> None:
    """In a worker process: each held chunk a grouped transfer cuts takes 20 ms longer (as
    :func:`_slow_fill` stretches made chunks), so that a kill seen in the transfer phase
    lands in it."""
    from rechunk_p2p.worker.plugin import RechunkWorkerPlugin

    group = RechunkWorkerPlugin.transfer_group_blocking
    if getattr(group, "stretched", False):
        return

    def slow_group(self, shuffle_id, flats, chunks):
        time.sleep(0.02 * len(flats))
        return group(self, shuffle_id, flats, chunks)

    slow_group.stretched = True
    RechunkWorkerPlugin.transfer_group_blocking = slow_group


def _kill_during(client, phase: str, seed: int, rows: int = 20, held: bool = False) -> dict:
    """Kill a worker in ``phase`` of a rechunk of inputs of ``rows`` rows (20: one transfer
    each; 5: three joined in each transfer; ``held``: persisted first, several chunks of one
    worker in each transfer); the scheduler plugin's counters after it."""
    with tempfile.TemporaryDirectory(prefix="rechunk-p2p-gate-") as gate_dir:
        gate = os.path.join(gate_dir, "killed")  # created once the victim is dead
        client.run(_gate_unpacks, gate)  # the run stays open until the victim is dead
        pids = _pids(client)  # before: a round trip less between seeing the phase and the kill
        x = _source(seed, rows, slow=not held)
        if held:
            client.run(_stretch_held_transfers)
            x = client.persist(x)
            wait(x)
        # bystander: fewer output chunks than workers, so one worker owns none
        target = (SHAPE[0], SHAPE[1] // 2) if phase == "bystander" else (SHAPE[0], 50)
        joined = rechunk_p2p.plan(x, target, n_workers=3).groups
        if not held:  # (held chunks are joined where neighbours sit on one worker)
            assert (joined is not None) == (rows == JOINED_ROWS), joined
        y = rechunk_p2p.rechunk(x, target)
        if held:
            graph = y.__dask_graph__()
            barrier = next(k for k in graph if str(k).startswith("rechunk_p2p-barrier"))
            groups = graph[barrier].spec.transfer_groups
            assert groups is not None and len(groups) < 240, groups
        if phase == "unpack":
            y = y.map_blocks(_slow_check_input, meta=np.empty((0, 0), DTYPE))
        ok = checked(y, _workload_like())
        future = client.compute(ok)
        deadline = time.monotonic() + TIMEOUT
        victim = _wait_for_phase(client, phase, deadline)
        os.kill(pids[victim], signal.SIGKILL)
        with open(gate, "w"):
            pass
        assert bool(future.result(timeout=max(deadline - time.monotonic(), 1))) is True
        del future
    return client.run_on_scheduler(_counters)


def _check_counters(phase: str, counters: dict) -> None:
    """A killed owner's run continues (its 8 of 24 outputs move), in every phase; a bystander
    is left behind. Neither starts a new run. The nanny's new worker joins the run where it
    is back while the continuation has at most half of its inputs sent (in the transfer
    phase, on a busy machine): it takes 8 outputs back, 4 from each other worker."""
    joined = counters.pop("joined")
    assert joined in (0, 1), counters
    if phase == "bystander":  # (2 outputs: a joined third worker takes none)
        assert counters == {"runs": 1, "restarts": 0, "continuations": 0, "moved": 0, "saved": 1}
    else:
        steps = 1 + joined
        expected = {"runs": 1, "restarts": 0, "continuations": steps, "moved": 8 * steps}
        assert counters == {**expected, "saved": 0}, f"{counters} ({joined} joined)"
    if phase in ("barrier", "unpack"):  # past the transfers: nothing joins
        assert not joined, counters


def _workload_like():
    from integration.workloads import Workload

    return Workload("kill", "kill test", SHAPE, DTYPE, (20, SHAPE[1]), (SHAPE[0], 50))


_INPUTS = pytest.mark.parametrize(
    ("rows", "held"),
    [(20, False), (JOINED_ROWS, False), (JOINED_ROWS, True)],
    ids=["one-chunk-transfers", "joined", "held-groups"],
)


@_INPUTS
@pytest.mark.parametrize("phase", PHASES)
def test_worker_killed_once(phase, rows, held):
    with _cluster() as client:
        _check_counters(phase, _kill_during(client, phase, seed=0, rows=rows, held=held))
        assert_clean_sync(client, timeout=30)


@pytest.mark.slow
@_INPUTS
@pytest.mark.parametrize("phase", PHASES)
def test_worker_killed_ten_times(phase, rows, held):
    for seed in range(10):
        with _cluster() as client:
            counters = _kill_during(client, phase, seed=seed + 1, rows=rows, held=held)
            _check_counters(phase, counters)
            assert_clean_sync(client, timeout=30)
