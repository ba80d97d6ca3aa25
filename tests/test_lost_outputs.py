"""An output assembled once, whose result is lost and wanted again while its run is open.

An output's pieces are freed as it is assembled, so a worker cannot assemble it twice. When
its result is lost after that (its consumers' results went with a worker that left, and
dask recomputes it), the run continues to assemble it again on the next worker: every input
sends its pieces of that output again, and nothing else of the run is done again.
"""

from __future__ import annotations

import asyncio
import time

import dask
import dask.array as da
import numpy as np
from distributed.utils_test import gen_cluster

import rechunk_p2p
from tests.conftest import assert_clean
from tests.engine_helpers import PLUGIN, THREE, check_result


async def _forgotten(s, key) -> None:
    while key in s.tasks:
        await asyncio.sleep(0.005)


async def _open_run_done(c) -> tuple:
    """A rechunk of 10 outputs, all assembled, whose run stays open: the client wants its
    barrier too, as the run stays open while other outputs are still to come. Returns the
    input, the graph, the outputs' keys and the futures of the barrier and the outputs."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 60)), (60, 6))
    graph = dict(y.__dask_graph__())
    (barrier,) = [k for k in graph if str(k).startswith("rechunk_p2p-barrier-")]
    outputs = sorted(y.__dask_keys__()[0])
    held, *futures = c.get(graph, [barrier, *outputs], sync=False)
    await c.gather(futures)
    return arr, graph, outputs, held, futures


@gen_cluster(client=True, nthreads=THREE)
async def test_an_output_lost_after_assembly_is_assembled_again_on_the_next_worker(c, s, *ws):
    arr, graph, outputs, held, futures = await _open_run_done(c)
    plugin = s.plugins[PLUGIN]
    (run,) = plugin.active.values()
    spec = run.run_spec
    flat = 3
    key = spec.spec.output_key(flat)
    first = spec.worker_for(flat)
    assert key == outputs[flat]
    assert s.tasks[key].who_has == {s.workers[first]}

    del futures[flat]  # its result goes; its pieces went as it was assembled
    await _forgotten(s, key)
    (again,) = c.get(graph, [key], sync=False)
    check_result(await asyncio.wait_for(again, 30), arr[:, 18:24])

    (second,) = {ws.address for ws in s.tasks[key].who_has}
    workers = run.run_spec.workers
    assert second == workers[(workers.index(first) + 1) % len(workers)]
    assert (
        plugin.runs_created,
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
    ) == (1, 0, 1)
    assert plugin.recovery.counts.remade == 1 and run.run_spec.moved == frozenset({flat})
    # every other output is as it was: assembled once, never again
    assert all(s.tasks[k].state == "memory" for k in outputs if k != key)
    del held, futures, again
    await assert_clean(s, *ws)


@gen_cluster(client=True, nthreads=THREE)
async def test_an_output_lost_twice_comes_back_to_a_worker_that_assembled_it(c, s, *ws):
    """Remade on the next worker each time: with three workers the third loss brings it
    back to the first, which assembles it again from the new pieces."""
    arr, graph, outputs, held, futures = await _open_run_done(c)
    plugin = s.plugins[PLUGIN]
    (run,) = plugin.active.values()
    flat, key = 7, outputs[7]
    places = [run.run_spec.worker_for(flat)]
    future = futures.pop(flat)
    for _ in range(3):
        del future
        await _forgotten(s, key)
        (future,) = c.get(graph, [key], sync=False)
        check_result(await asyncio.wait_for(future, 30), arr[:, 42:48])
        places.append(run.run_spec.worker_for(flat))
        assert {ws.address for ws in s.tasks[key].who_has} == {places[-1]}
    assert places[3] == places[0] and len(set(places)) == 3, places
    assert (
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
        plugin.recovery.counts.remade,
    ) == (0, 3, 3)
    del held, futures, future
    await assert_clean(s, *ws)


def _slow(block):
    time.sleep(0.02)
    return block + 1


@gen_cluster(client=True, nthreads=THREE)
async def test_a_consumer_lost_with_a_worker_makes_the_run_assemble_its_output_again(
    c, s, a, b, w3
):
    """The way it happens: outputs of other workers consumed on one worker, which leaves
    while the run is open. Its own outputs move; the others' outputs whose consumers'
    results it took with it are assembled again, and the rechunk does not restart."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 60)), (60, 2))  # 30 outputs
    with dask.annotate(workers=[w3.address], allow_other_workers=True):
        z = y.map_blocks(_slow)  # consumers on w3 while it is there
    outputs = y.__dask_keys__()[0]
    zs = c.persist(z, optimize_graph=False)
    plugin = s.plugins[PLUGIN]
    while not plugin.active:
        await asyncio.sleep(0.005)
    (run,) = plugin.active.values()
    spec = run.run_spec
    others = [k for f, k in enumerate(outputs) if spec.worker_for(f) != w3.address]

    def consumed_on_w3() -> int:
        """Outputs of other workers released, whose consumer's result only w3 holds (the
        annotation lets a busy w3's consumers run elsewhere too)."""
        n = 0
        for key in others:
            consumer = s.tasks.get((z.name, *key[1:]))
            if s.tasks[key].state == "released" and consumer is not None:
                n += {ws.address for ws in consumer.who_has or ()} == {w3.address}
        return n

    while consumed_on_w3() < 3:
        await asyncio.sleep(0.002)
    assert plugin.active, "the run ended before w3 left"
    await w3.close()
    check_result(await asyncio.wait_for(c.compute(zs), 60), arr + 1)
    assert plugin.recovery.counts.restarts == 0, plugin.recovery.counts.restarts
    assert plugin.recovery.counts.remade >= 3, plugin.recovery.counts.remade
    assert plugin.recovery.counts.continuations == 1, (
        plugin.recovery.counts.continuations
    )  # (its outputs and the others)
    del zs
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=THREE)
async def test_a_report_from_a_worker_that_no_longer_has_the_output_changes_nothing(c, s, *ws):
    """A lost output reported by a worker that is not its worker in the run (it moved
    meanwhile): its task runs where it is now; the run goes on as it is."""
    arr, graph, outputs, held, futures = await _open_run_done(c)
    plugin = s.plugins[PLUGIN]
    (run,) = plugin.active.values()
    spec = run.run_spec
    flat = 5
    other = next(w for w in spec.workers if w != spec.worker_for(flat))
    reply = plugin.restart_run(spec.shuffle_id, spec.run_id, "lost", output=flat, worker=other)
    assert reply == {"status": "OK"}
    assert run.run_spec is spec and plugin.active
    assert (
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
        plugin.recovery.counts.remade,
    ) == (0, 0, 0)
    # reported by its worker, it is assembled again
    plugin.restart_run(
        spec.shuffle_id, spec.run_id, "lost", output=flat, worker=spec.worker_for(flat)
    )
    assert (
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
        plugin.recovery.counts.remade,
    ) == (0, 1, 1)
    assert run.run_spec.worker_for(flat) != spec.worker_for(flat)
    del futures[flat]
    await _forgotten(s, outputs[flat])
    (again,) = c.get(graph, [outputs[flat]], sync=False)
    check_result(await asyncio.wait_for(again, 30), arr[:, 30:36])
    del held, futures, again
    await assert_clean(s, *ws)


@gen_cluster(client=True, nthreads=THREE)
async def test_outputs_lost_together_are_assembled_again_by_one_continuation(c, s, *ws):
    """Every transfer runs again in a continuation: the outputs wanted again at once are
    assembled again together, each on the worker after its own, not one continuation each."""
    arr, graph, outputs, held, futures = await _open_run_done(c)
    plugin = s.plugins[PLUGIN]
    (run,) = plugin.active.values()
    lost = [1, 4, 8]
    first = {flat: run.run_spec.worker_for(flat) for flat in lost}
    for flat in sorted(lost, reverse=True):
        del futures[flat]
    for flat in lost:
        await _forgotten(s, outputs[flat])
    again = c.get(graph, [outputs[flat] for flat in lost], sync=False)
    for flat, future in zip(lost, again):
        check_result(await asyncio.wait_for(future, 30), arr[:, 6 * flat : 6 * flat + 6])
    assert (
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.continuations,
        plugin.recovery.counts.remade,
    ) == (0, 1, 3)
    workers = run.run_spec.workers
    for flat in lost:
        (where,) = {ws.address for ws in s.tasks[outputs[flat]].who_has}
        assert where == workers[(workers.index(first[flat]) + 1) % len(workers)]
    assert all(s.tasks[k].state == "memory" for k in outputs if k in s.tasks)
    del held, futures, again
    await assert_clean(s, *ws)
