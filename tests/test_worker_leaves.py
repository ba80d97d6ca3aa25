"""A worker leaves mid-rechunk (``retire_workers``, or gone): who restarts what.

A worker that assembles no output of a run (a bystander) leaves without restarting it: only
the transfers it ran are run again, elsewhere. When a worker that assembles outputs leaves, the
run continues without it: its outputs move to the others (their pieces are sent again), whose
pieces and finished outputs are kept. Nothing is lost either way.
"""

from __future__ import annotations

import asyncio
import threading
import time

import dask.array as da
import numpy as np
import pytest
from distributed.core import Status
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.errors import StaleRunError
from tests.conftest import assert_clean
from tests.engine_helpers import ONE, PLUGIN, THREE, check_result


def _slow(block):
    time.sleep(0.03)  # keep the transfers running while a worker leaves
    return block


async def _never(*args, **kwargs) -> None:
    """A data-plane send that never completes."""
    await asyncio.Event().wait()


async def _run_once_active(s) -> object:
    plugin = s.plugins[PLUGIN]
    while not plugin.active:
        await asyncio.sleep(0.005)
    (run,) = plugin.active.values()
    return run


def _rechunk(n_outputs: int) -> tuple[da.Array, np.ndarray]:
    """60 slow row blocks -> ``n_outputs`` column blocks (fewer than 3: a bystander)."""
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    x = da.from_array(arr, chunks=(1, 60)).map_blocks(_slow)
    return rechunk_p2p.rechunk(x, (60, 60 // n_outputs)), arr


@pytest.mark.parametrize("how", ["retire", "close"])
@gen_cluster(client=True, nthreads=THREE)
async def test_a_bystander_leaving_does_not_restart_the_rechunk(c, s, *workers, how):
    await rechunk_p2p.register(c)
    y, arr = _rechunk(n_outputs=2)
    future = c.compute(y)
    run = await _run_once_active(s)
    (bystander,) = set(run.run_spec.workers) - run.owners
    worker = next(w for w in workers if w.address == bystander)
    worker.plugins[PLUGIN].dataplane.send = _never  # injected: its pieces never arrive
    while not worker.state.executed_count:
        await asyncio.sleep(0.005)  # it ran transfers, whose pieces are stuck on it
    if how == "retire":  # its transfers' results move to other workers, its pieces do not
        await c.retire_workers([bystander], close_workers=True)
    else:  # its results and queued sends are simply gone
        await worker.close()
    check_result(await asyncio.wait_for(future, 60), arr)
    plugin = s.plugins[PLUGIN]
    assert plugin.runs_created == 1  # no restart
    assert plugin.recovery.counts.restarts_saved == 1
    del future
    await assert_clean(s, *(w for w in workers if w is not worker))


async def retire_an_owner_once_it_transferred(c, s, workers) -> str:
    """Retire the first owner of the active run once it ran a transfer; its address."""
    run = await _run_once_active(s)
    owner = sorted(run.owners)[0]
    while not any(w.address == owner and w.state.executed_count for w in workers):
        await asyncio.sleep(0.005)
    await c.retire_workers([owner], close_workers=True)
    return owner


@gen_cluster(client=True, nthreads=THREE)
async def test_a_retiring_owner_continues_the_rechunk_and_loses_nothing(c, s, *workers):
    await rechunk_p2p.register(c)
    y, arr = _rechunk(n_outputs=6)
    future = c.compute(y)
    owner = await retire_an_owner_once_it_transferred(c, s, workers)
    check_result(await asyncio.wait_for(future, 60), arr)
    plugin = s.plugins[PLUGIN]
    assert (
        plugin.runs_created,
        plugin.recovery.counts.continuations,
        plugin.recovery.counts.restarts,
    ) == (1, 1, 0)
    assert plugin.recovery.counts.restarts_saved == 0 and plugin.recovery.counts.outputs_moved == 2
    del future
    await assert_clean(s, *(w for w in workers if w.address != owner))


def _finished(s, keys) -> set:
    return {k for k in keys if k in s.tasks and s.tasks[k].state == "memory"}


def _computed(s, key) -> int:
    """How many times the scheduler saw ``key`` computed."""
    return sum(1 for event in s.story(key) if event[0] == key and event[2] == "memory")


@gen_cluster(client=True, nthreads=THREE)
async def test_an_owner_leaving_after_the_barrier_continues_the_run_keeping_finished_outputs(
    c, s, *workers
):
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 60)), (60, 2))  # 30 outputs
    future = c.compute(y.map_blocks(_slow))  # slow consumers stretch the unpack phase
    run = await _run_once_active(s)
    spec = run.run_spec
    keys = {spec.spec.output_key(flat): spec.worker_for(flat) for flat in spec.spec.outputs}
    barrier = s.tasks[f"rechunk_p2p-barrier-{spec.shuffle_id}"]
    while barrier.state != "memory" or len(_finished(s, keys)) < 4:
        await asyncio.sleep(0.002)
    owner = sorted(spec.owners())[0]
    kept = {k for k in _finished(s, keys) if keys[k] != owner}
    await next(w for w in workers if w.address == owner).close()
    check_result(await asyncio.wait_for(future, 60), arr)
    plugin = s.plugins[PLUGIN]
    assert (
        plugin.runs_created,
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
    ) == (1, 0, 1)
    assert plugin.recovery.counts.outputs_moved == sum(1 for w in keys.values() if w == owner) == 10
    assert plugin.recovery.counts.outputs_kept >= len(kept) > 0
    assert all(_computed(s, key) == 1 for key in kept)  # not computed again
    del future
    await assert_clean(s, *(w for w in workers if w.address != owner))


def _slow_rows(block_info=None) -> np.ndarray:
    """Rows of ``np.arange(3600).reshape(60, 60)``, each made in 30 ms."""
    time.sleep(0.03)
    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    return (np.arange(r0, r1)[:, None] * 60 + np.arange(c0, c1)).astype("f8")


def _hold_sends(worker) -> threading.Event:
    """Injected: the worker's data-plane sends wait until the event is set (as pieces wait in
    its send queues for a message's worth, or for the barrier). Its loop is another thread's,
    hence a threading event, polled."""
    dataplane = worker.plugins[PLUGIN].dataplane
    send, gate = dataplane.send, threading.Event()

    async def held(*args, **kwargs):
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return await send(*args, **kwargs)

    dataplane.send = held
    return gate


@gen_cluster(client=True, nthreads=ONE * 4)
async def test_a_bystander_leaving_a_continued_run_with_pieces_it_never_sent(c, s, *workers):
    """In a continued run a transfer sends only the moved outputs' pieces: the inputs a
    bystander had cut in full for an earlier run, their pieces still queued on it, must be
    sent in full again when it leaves (a 12-worker chaos run lost them this way)."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    x = da.map_blocks(_slow_rows, chunks=((1,) * 60, (60,)), dtype="f8")  # made: no aliases
    future = c.compute(rechunk_p2p.rechunk(x, (60, 30)))  # 2 owners, 2 bystanders
    run = await _run_once_active(s)
    by_address = {w.address: w for w in workers}
    bystanders = sorted(set(run.run_spec.workers) - run.owners)
    gates = {b: _hold_sends(by_address[b]) for b in bystanders}
    computed_on = s.plugins[PLUGIN].recovery.computed_on
    while not set(bystanders) <= set(computed_on.values()):
        await asyncio.sleep(0.005)  # each cut inputs in full; their pieces wait on it
    await by_address[sorted(run.owners)[0]].close()  # run 2 continues run 1
    while run.run_spec.run_id == 1:
        await asyncio.sleep(0.005)
    (leaver,) = [b for b in bystanders if b not in run.owners]  # still without outputs
    assert leaver in run.full_by.values(), run.full_by
    for b in bystanders:
        if b != leaver:
            gates[b].set()
    await by_address[leaver].close()  # with the pieces it held
    check_result(await asyncio.wait_for(future, 60), arr)
    plugin = s.plugins[PLUGIN]
    assert (
        plugin.runs_created,
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
    ) == (1, 0, 2)
    del future
    await assert_clean(s, *(w for w in workers if w.status.name == "running"))


@gen_cluster(client=True, nthreads=ONE * 4)
async def test_a_bystander_leaving_a_continued_run_runs_again_only_the_transfers_it_affects(
    c, s, *workers
):
    """When a bystander leaves a continued run, the run continues again with no output
    moved: only the transfers that ran on it or must send in full run again; the others'
    results count for the new run as they are."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    x = da.map_blocks(_slow_rows, chunks=((1,) * 60, (60,)), dtype="f8")
    future = c.compute(rechunk_p2p.rechunk(x, (60, 30)))  # 2 owners, 2 bystanders
    run = await _run_once_active(s)
    plugin = s.plugins[PLUGIN]
    by_address = {w.address: w for w in workers}
    bystanders = sorted(set(run.run_spec.workers) - run.owners)
    gates = {b: _hold_sends(by_address[b]) for b in bystanders}
    while not set(bystanders) <= set(plugin.recovery.computed_on.values()):
        await asyncio.sleep(0.005)
    await by_address[sorted(run.owners)[0]].close()  # run 2 continues run 1
    barrier = s.tasks[f"rechunk_p2p-barrier-{run.run_spec.shuffle_id}"]
    transfers = [dt.key for dt in barrier.dependencies]
    while run.run_spec.run_id == 1 or any(s.tasks[k].state != "memory" for k in transfers):
        await asyncio.sleep(0.005)  # every transfer ran for run 2; the barrier waits
    (leaver,) = [b for b in bystanders if b not in run.owners]
    ran_there = sum(1 for k in transfers if plugin.recovery.computed_on.get(k) == leaver)
    computed = sum(_computed(s, k) for k in transfers)
    moved = run.run_spec.moved
    for b in bystanders:
        if b != leaver:
            gates[b].set()
    await by_address[leaver].close()  # run 3 continues run 2, no output moved
    assert run.run_spec.run_id == 3 and run.run_spec.moved == moved
    resent = len(run.run_spec.resend_all)
    check_result(await asyncio.wait_for(future, 60), arr)
    again = sum(_computed(s, k) for k in transfers) - computed
    assert 0 < again <= ran_there + resent < len(transfers), (again, ran_there, resent)
    assert (
        plugin.recovery.counts.transfers_rerun - len(transfers) <= again
    )  # (run 2 reran every one)
    assert (
        plugin.runs_created,
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
    ) == (1, 0, 2)
    del future
    await assert_clean(s, *(w for w in workers if w.status.name == "running"))


@gen_cluster(client=True, nthreads=ONE * 2)
async def test_a_closing_worker_never_passes_a_barrier_it_has_no_run_for(c, s, a, b):
    """A barrier asked again of a worker whose runs its close already dropped (the first
    request's connection broke under the close) must not pass there: the pieces it had
    queued are gone. It replies an error, and the scheduler, seeing the worker closing,
    reschedules the barrier instead of passing it on."""
    await rechunk_p2p.register(c)
    plugin = a.plugins["rechunk-p2p"]
    await plugin._pass_barrier("no-such-rechunk", 1)  # open: it sent nothing, it passes
    plugin._tearing_down = True
    try:
        with pytest.raises(StaleRunError, match="is closing"):
            await plugin._pass_barrier("no-such-rechunk", 1)
    finally:
        plugin._tearing_down = False
    scheduler_plugin = s.plugins[PLUGIN]
    assert not scheduler_plugin._closing(a.address)
    s.workers[a.address].status = Status.closing
    assert scheduler_plugin._closing(a.address)
    assert scheduler_plugin._closing("tcp://127.0.0.1:1")  # not in the cluster
    s.workers[a.address].status = Status.running
