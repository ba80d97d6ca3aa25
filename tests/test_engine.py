"""Whole rechunks on in-process clusters (gen_cluster): results, storage, cleanup."""

from __future__ import annotations

import asyncio
import threading
import time

import dask
import dask.array as da
import numpy as np
import pytest
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.transport.comm import RetryPolicy
from tests.conftest import assert_clean

NTHREADS_2 = [("127.0.0.1", 1), ("127.0.0.1", 1)]


@pytest.fixture(autouse=True)
def _short_idle(monkeypatch):
    """The in-process workers here count a second without tasks as idle (5 s in a real
    worker): the tests that wait for the idle unfreeze wait less."""
    monkeypatch.setattr("rechunk_p2p.worker.idle.UNFREEZE_IDLE_SECONDS", 1.0)


async def _check(c, s, workers, x, chunks):
    await rechunk_p2p.register(c)
    y = rechunk_p2p.rechunk(x, chunks)
    expected = x.rechunk(chunks, method="tasks")
    assert y.chunks == expected.chunks
    result = await c.compute(y)
    np.testing.assert_array_equal(result, await c.compute(x))
    assert result.dtype == x.dtype
    await assert_clean(s, *workers)
    return y


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_rows_to_columns(c, s, a, b, storage):
    x = da.random.default_rng(0).random((60, 50), chunks=(6, 50))
    await _check(c, s, [a, b], x, (60, 5))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_single_worker(c, s, a, storage):
    x = da.arange(1000, chunks=7).reshape(20, 50).rechunk((3, 50))
    await _check(c, s, [a], x, (20, 3))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_three_workers_3d(c, s, a, b, w3, storage):
    x = da.random.default_rng(1).random((12, 10, 8), chunks=(1, 10, 8)).astype("f4")
    await _check(c, s, [a, b, w3], x, (12, 3, 4))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 8)
async def test_eight_workers_made_and_held(c, s, *workers, storage):
    """Eight workers: an all-to-all rechunk of a made and of a held input, every worker
    cutting and assembling (outputs spread over all of them), values as dask's."""
    await rechunk_p2p.register(c)
    x = da.random.default_rng(8).random((64, 48), chunks=(2, 48))
    await _check(c, s, workers, x, (64, 3))
    held = c.persist(x)
    y = rechunk_p2p.rechunk(held, (64, 3))
    futures = c.persist(y)
    result = await c.compute(y)
    np.testing.assert_array_equal(result, await c.compute(x))
    where = await c.who_has(futures)
    assert len({w for ws in where.values() for w in ws}) == 8  # outputs on every worker
    del futures, held
    await assert_clean(s, *workers)


@gen_cluster(
    client=True,
    nthreads=NTHREADS_2,
    config={"rechunk-p2p.storage": "disk", "rechunk-p2p.comm.run-buffer-bytes": "16KiB"},
)
async def test_with_disk_storage_memory_held_stays_within_the_configured_buffers(c, s, a, b):
    """The engine's own statistics: the disk store's write buffer holds at most its size
    plus one input chunk's pieces (the write that fills it), the send queue at most the
    run's budget; everything else went to disk."""
    from rechunk_p2p.spec import PLUGIN_NAME

    buffer_bytes = 8 * 2**10
    x = da.random.default_rng(3).random((400, 400), chunks=(10, 400))  # 32 KB inputs
    with dask.config.set({"rechunk-p2p.disk-write-buffer-bytes": buffer_bytes}):
        await _check(c, s, [a, b], x, (400, 10))
    totals = [w.plugins[PLUGIN_NAME].totals() for w in (a, b)]
    for t in totals:
        assert buffer_bytes <= t.max_bytes_stored_in_memory <= buffer_bytes + 32_000, t
        assert 0 < t.max_bytes_queued <= 16 * 2**10, t
        assert t.bytes_spilled > 400 * 400 * 8 // 2 // 2, t  # most of its half on disk


@gen_cluster(
    client=True, nthreads=NTHREADS_2, config={"rechunk-p2p.comm.run-buffer-bytes": "16KiB"}
)
async def test_a_run_budget_bounds_each_workers_send_queue(c, s, a, b, storage):
    """``comm.run-buffer-bytes`` rides in the graph and bounds what a worker holds queued."""
    from rechunk_p2p.spec import PLUGIN_NAME

    x = da.random.default_rng(2).random((400, 400), chunks=(10, 400))  # 32 KB inputs
    y = await _check(c, s, [a, b], x, (400, 10))
    specs = [
        t.kwargs["spec"]
        for t in dict(y.__dask_graph__()).values()
        if getattr(t, "kwargs", None) and "spec" in t.kwargs
    ]
    assert specs and {spec.send_buffer_bytes for spec in specs} == {16 * 2**10}
    totals = [w.plugins[PLUGIN_NAME].totals() for w in (a, b)]
    assert all(t.bytes_sent > 0 for t in totals)
    assert all(0 < t.max_bytes_queued <= 16 * 2**10 for t in totals), totals
    # every phase was timed on every worker (both cut, sent, stored and assembled)
    for t in totals:
        phases = t.phases
        assert min(phases.cut, phases.send, phases.store, phases.assemble) > 0, phases
        assert t.messages_sent > 0  # (batches, each one message)


@gen_cluster(
    client=True,
    nthreads=NTHREADS_2,
    config={"rechunk-p2p.comm.buffer-bytes-limit": "24KiB", "rechunk-p2p.storage": "disk"},
)
async def test_the_send_queue_stays_within_the_workers_buffer(c, s, a, b):
    """What a worker holds for sending never exceeds ``comm.buffer-bytes-limit`` (measured by
    the engine itself); with disk storage the received pieces are on disk, not held."""
    from rechunk_p2p.spec import PLUGIN_NAME

    x = da.random.default_rng(3).random((400, 400), chunks=(10, 400))  # 16 KB per batch
    await _check(c, s, [a, b], x, (400, 10))
    totals = [w.plugins[PLUGIN_NAME].totals() for w in (a, b)]
    assert all(t.bytes_spilled > 0 for t in totals)
    assert all(0 < t.max_bytes_queued <= 24 * 2**10 for t in totals), totals


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_lost_acks_are_retried_without_duplicating_data(c, s, a, b, storage, monkeypatch):
    """Deliver every batch, then fail as if the ack was lost: the retry delivers it again."""
    from rechunk_p2p.transport.dataplane import DataPlane

    original = DataPlane.send
    failed: set[tuple] = set()

    async def send_then_lose_ack(self, address, shuffle_id, run_id, pieces):
        await original(self, address, shuffle_id, run_id, pieces)
        ident = (address, tuple((p.outputs, p.inputs) for p in pieces))
        if ident not in failed:
            failed.add(ident)
            raise OSError("injected: ack lost")

    monkeypatch.setattr(DataPlane, "send", send_then_lose_ack)
    monkeypatch.setattr("rechunk_p2p.transport.comm.RETRY", RetryPolicy(5, 0.001, 5.0))
    x = da.random.default_rng(2).random((40, 30), chunks=(4, 30))
    await _check(c, s, [a, b], x, (40, 3))
    assert failed, "no batch crossed workers"


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_persistent_comm_failure_fails_the_rechunk_and_cleans_up(c, s, a, b, monkeypatch):
    from rechunk_p2p.transport.dataplane import DataPlane

    async def always_fail(self, address, shuffle_id, run_id, pieces):
        raise OSError("injected: network down")

    monkeypatch.setattr(DataPlane, "send", always_fail)
    await rechunk_p2p.register(c)
    monkeypatch.setattr("rechunk_p2p.transport.comm.RETRY", RetryPolicy(5, 0.001, 0.002))
    x = da.random.default_rng(3).random((40, 30), chunks=(4, 30))
    y = rechunk_p2p.rechunk(x, (40, 3))
    with pytest.raises(rechunk_p2p.RechunkCommError, match="network down"):
        await c.compute(y)
    del y
    await assert_clean(s, a, b)


@pytest.mark.parametrize(
    "source, target",
    [((512, 128), (128, 512)), ((256, 256), (128, 512))],
    ids=["stacked", "pieces"],
)
@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_outputs_on_kept_pages_are_written_whole(c, s, a, b, storage, source, target):
    """Kept pages are handed out as they are: with the pool full of freed outputs whose
    every byte is 0xFF (NaN), the outputs made on them must still be exactly the input.
    (Pieces of 128 KiB and more: each output gets pages of its own, not a slab.)"""
    from rechunk_p2p.store.pages import OUTPUT_PAGES

    x = da.random.default_rng(3).random((512, 512), chunks=source)
    nbytes = target[0] * target[1] * 8
    OUTPUT_PAGES.open()  # as a run does: freed mappings are kept
    try:
        poisoned = [OUTPUT_PAGES.take_blocking(nbytes) for _ in range(4)]
        for array in poisoned:
            array[:] = 0xFF
        del poisoned, array
        assert OUTPUT_PAGES.held_bytes >= 4 * nbytes
        reused = OUTPUT_PAGES.reused
        await _check(c, s, [a, b], x, target)
        assert OUTPUT_PAGES.reused - reused >= 4
    finally:
        unmap = OUTPUT_PAGES.close()
        if unmap is not None:
            unmap()


def _runs(worker) -> dict:
    plugin = worker.plugins.get("rechunk-p2p")
    return plugin.runs if plugin is not None else {}


def _slow_block(block):
    import time

    time.sleep(0.05)  # keep the transfers running while the workers go
    return block


@gen_cluster(
    client=True,
    nthreads=NTHREADS_2,
    config={"distributed.scheduler.no-workers-timeout": "1s"},
)
async def test_no_workers_left_fails_with_one_clear_error(c, s, a, b):
    """Every worker gone mid-rechunk: with distributed's ``no-workers-timeout`` the rechunk
    fails with distributed's own error (without it, it waits for workers, as any dask
    computation does), and no run state is left on the scheduler."""
    from distributed.scheduler import NoWorkerError

    from rechunk_p2p.spec import PLUGIN_NAME

    await rechunk_p2p.register(c)
    x = da.ones((40, 40), chunks=(1, 40)).map_blocks(_slow_block)
    future = c.compute(rechunk_p2p.rechunk(x, (40, 1)))
    plugin = s.plugins[PLUGIN_NAME]
    while not plugin.active:
        await asyncio.sleep(0.01)
    await asyncio.gather(a.close(), b.close())
    with pytest.raises(NoWorkerError, match="without any running workers"):
        await asyncio.wait_for(future, 30)
    while plugin.active:  # the barrier's failure closes the run
        await asyncio.sleep(0.01)


def test_a_barrier_task_survives_substitution():
    """dask copies tasks with ``substitute`` (e.g. when a delayed call takes the array):
    the barrier keeps its spec and stays a barrier."""
    from dask._task_spec import TaskRef

    import rechunk_p2p
    from rechunk_p2p.graph import BarrierTask

    x = da.ones((8, 8), chunks=(1, 8))
    y = rechunk_p2p.rechunk(x, (8, 1))
    barriers = [t for t in dict(y.__dask_graph__()).values() if isinstance(t, BarrierTask)]
    assert len(barriers) == 1
    (barrier,) = barriers
    dep = next(iter(barrier.dependencies))
    copy = barrier.substitute({dep: TaskRef(("renamed", 0))})
    assert isinstance(copy, BarrierTask) and copy.spec is barrier.spec
    assert ("renamed", 0) in copy.dependencies and dep not in copy.dependencies


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_idle_data_plane_connections_are_closed(c, s, a, b, monkeypatch):
    """A worker idle for UNFREEZE_IDLE_SECONDS lets its free receive buffers go, and keeps
    the data plane's connections until CONNECTIONS_IDLE_SECONDS (both shortened here): the
    next rechunk of a session finds them open. Then it closes those no send uses; the next
    rechunk opens what it needs."""
    from rechunk_p2p.transport.dataplane import DataPlane
    from rechunk_p2p.worker import idle as idle_module

    closed = []
    original = DataPlane.close_idle

    async def close_idle(self):
        before = self.idle_connections()
        await original(self)
        closed.append((before, self.idle_connections(), time.monotonic()))

    monkeypatch.setattr(DataPlane, "close_idle", close_idle)
    monkeypatch.setattr(idle_module, "UNFREEZE_IDLE_SECONDS", 0.2)
    monkeypatch.setattr(idle_module, "CONNECTIONS_IDLE_SECONDS", 3.0)
    await rechunk_p2p.register(c)
    x = da.random.default_rng(5).random((40, 30), chunks=(4, 30))
    await _check(c, s, [a, b], x, (40, 3))
    planes = [w.plugins["rechunk-p2p"].dataplane for w in (a, b)]
    while any(p.free_buffer_bytes() for p in planes):
        await asyncio.sleep(0.02)
    let_go = time.monotonic()
    assert all(p.idle_connections() for p in planes) and not closed
    for _ in range(300):
        if len(closed) >= 2 and not any(p.idle_connections() for p in planes):
            break
        await asyncio.sleep(0.05)
    assert len(closed) >= 2 and all(before > 0 and after == 0 for before, after, _ in closed)
    assert min(when for *_, when in closed) - let_go > 1.5  # (3 s idle, 0.2 s at let_go)
    await _check(c, s, [a, b], x, (40, 5))  # connections are opened again


@gen_cluster(client=True, nthreads=NTHREADS_2)
async def test_the_setup_imports_what_tasks_need_on_the_worker_loop(c, s, a, b, monkeypatch):
    """Each worker imports the task modules in its event loop's thread, where distributed
    decodes tasks: in a thread beside it, a concurrent import of zarr could leave both
    with a half-initialised module (see rechunk_p2p.worker.imports)."""
    from rechunk_p2p.worker import plugin as plugin_module

    threads = []
    monkeypatch.setattr(
        plugin_module, "import_task_modules_blocking", lambda: threads.append(threading.get_ident())
    )
    await rechunk_p2p.register(c)
    assert threads == [threading.get_ident()] * 2  # (gen_cluster's workers share its loop)


@gen_cluster(
    client=True,
    nthreads=NTHREADS_2,
    config={"rechunk-p2p.storage": "memory", "rechunk-p2p.comm.message-bytes-limit": "16KiB"},
)
async def test_received_payloads_buffers_are_read_into_again(c, s, a, b):
    """Outputs filled as their pieces arrive (the memory store): a received message's buffer
    is free once its pieces are copied out, and later messages are read into it; the values
    stay those of dask's rechunk."""
    x = da.random.default_rng(7).random((64, 2048), chunks=(2, 2048))
    await _check(c, s, [a, b], x, (64, 64))
    for worker in (a, b):
        buffers = worker.plugins["rechunk-p2p"].dataplane.receive_buffers
        assert buffers.reused > buffers.made > 0


@pytest.fixture
def cut_or_sent(monkeypatch):
    """Counts of input chunks cut, and sent in place (as blocks of the chunk), on the
    in-process workers."""
    from rechunk_p2p.cutting.cutter import InputCutter

    counts = {"cut": 0, "in place": 0}
    cut, send = InputCutter.cut_blocking, InputCutter.send_in_place

    def counted(name, method):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(InputCutter, "cut_blocking", counted("cut", cut))
    monkeypatch.setattr(InputCutter, "send_in_place", counted("in place", send))
    return counts


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 4)
async def test_wide_rows_go_in_place_from_held_and_made_chunks(
    c, s, *workers, storage, cut_or_sent
):
    """Rows of 4 KiB into columns on 4 workers: with the memory store every input chunk's
    pieces travel as blocks of the chunk itself, held or made (the disk store keeps what
    it gets: cut); values as dask's either way."""
    await rechunk_p2p.register(c)
    x = da.random.default_rng(4).random((64, 2048), chunks=(8, 2048))
    await _check(c, s, workers, x, (64, 128))
    held = c.persist(x)
    await _check(c, s, workers, held, (64, 128))
    sent = 2 * x.numblocks[0]
    if storage == "memory":
        assert cut_or_sent == {"cut": 0, "in place": sent}
    else:
        assert cut_or_sent == {"cut": sent, "in place": 0}
    del held


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_maps_into_series_in_place_block_by_grid_row(c, s, a, b, w3, cut_or_sent):
    """Maps cut along two axes (4 x 2 tiles of 1 KiB rows) into series on 3 workers: a
    worker's tiles of a map span grid rows, one block each; a map of Fortran order is cut."""
    await rechunk_p2p.register(c)
    x = da.random.default_rng(5).random((6, 64, 512), chunks=(1, 64, 512)).astype("f4")
    await _check(c, s, [a, b, w3], x, (6, 16, 256))
    assert cut_or_sent == {"cut": 0, "in place": 6}
    fortran = x.map_blocks(np.asfortranarray)
    await _check(c, s, [a, b, w3], fortran, (6, 16, 256))
    assert cut_or_sent == {"cut": 6, "in place": 6}
