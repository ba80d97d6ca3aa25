"""Races and faults on the worker side, made deterministic through a seam.

Real plugins, runs, comm buffers and stores; a scripted scheduler and an in-process network
(``tests/worker_fakes.py``). Each test orders one race or injects one fault and checks the
outcome and that nothing is left open or held.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
from types import SimpleNamespace
from unittest import mock

import dask
import numpy as np
import pytest
from distributed import Reschedule
from distributed.utils_test import gen_test

from rechunk_p2p.errors import RechunkCommError, RechunkRunError, StaleRunError
from rechunk_p2p.transport.comm import RetryPolicy
from rechunk_p2p.worker import tuning as tuning_module
from rechunk_p2p.worker.scheduler_rpc import checked
from tests.worker_fakes import (
    SHUFFLE,
    FakeScheduler,
    Network,
    close_all,
    fake_worker,
    input_chunk,
    make_run_spec,
)

WORKERS = ("a", "b")
ROWS, COLUMNS = 8, 4


@contextlib.contextmanager
def fast_retries(count: int = 5):
    """Retries 1-2 ms apart (``count`` of them) for the sends of runs made in the block."""
    with mock.patch("rechunk_p2p.transport.comm.RETRY", RetryPolicy(count, 0.001, 0.002)):
        yield


def strided_chunk(flat: int) -> np.ndarray:
    """:func:`input_chunk` as a view that is not C-contiguous: cut into a buffer, where a
    C-contiguous chunk's pieces are sent in place (see rechunk_p2p.cutting.in_place)."""
    chunk = input_chunk(flat)
    spaced = np.zeros((chunk.shape[0], 2 * chunk.shape[1]), chunk.dtype)
    spaced[:, ::2] = chunk
    return spaced[:, ::2]


def expected_output(flat: int, columns: int = COLUMNS) -> np.ndarray:
    full = np.concatenate([input_chunk(i) for i in range(ROWS)])
    width = 12 // columns
    return full[:, flat * width : (flat + 1) * width]


@pytest.fixture
def seam(tmp_path):
    """``async with seam(storage, run_id) as (scheduler, network, plugins)``: workers a and
    b (or ``workers``), made inside the test's loop; on the way out every run is closed, and
    the test fails if anything was left open, held or on disk."""

    @contextlib.asynccontextmanager
    async def make(storage: str = "memory", run_id: int = 1, workers=WORKERS, columns=COLUMNS):
        tuning_before = tuning_module.PROCESS_TUNING.holds
        scheduler = FakeScheduler(make_run_spec(workers, run_id, storage, ROWS, columns))
        network = Network()
        plugins = [fake_worker(w, scheduler, network, str(tmp_path / w)) for w in workers]
        try:
            yield scheduler, network, plugins
        finally:
            if network.hold is not None:
                network.hold.set()
            await close_all(plugins)
        assert_nothing_left(plugins, tmp_path, tuning_before)

    return make


async def transfer_all(plugins, return_exceptions: bool = False) -> list:
    """Every input chunk, alternating between the workers, from task threads; their run ids
    (or errors). Every thread has finished when this returns."""
    n = len(plugins)
    return list(
        await asyncio.gather(
            *(
                asyncio.to_thread(plugins[i % n].transfer_blocking, SHUFFLE, i, input_chunk(i))
                for i in range(ROWS)
            ),
            return_exceptions=return_exceptions,
        )
    )


async def barrier(plugin, run_ids) -> int:
    return await asyncio.to_thread(plugin.barrier_blocking, SHUFFLE, tuple(run_ids))


async def unpack(plugin, flat: int, run_id: int = 1):
    return await asyncio.to_thread(plugin.unpack_blocking, SHUFFLE, flat, run_id, ("out", 0, flat))


async def assert_outputs(plugins, run_id: int = 1) -> None:
    by_address = {p.worker.address: p for p in plugins}
    run_spec = plugins[0].runs[SHUFFLE].run_spec
    for flat in range(COLUMNS):
        out = await unpack(by_address[run_spec.worker_for(flat)], flat, run_id)
        np.testing.assert_array_equal(out, expected_output(flat))


def assert_nothing_left(plugins, tmp_path, tuning_before: int) -> None:
    for p in plugins:
        assert not p.runs
        assert p.dataplane.limiter.used == 0
    assert tuning_module.PROCESS_TUNING.holds == tuning_before  # every run released it
    # the fake workers have no idle watch: unfreeze what their runs froze, as it would, so
    # that the process is as the next test expects it
    tuning_module.PROCESS_TUNING.unfreeze_unused(collect=False)
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert leftovers == []


@pytest.mark.parametrize("storage", ["memory", "disk"])
@gen_test()
async def test_a_run_through_the_seam_assembles_every_output(seam, tmp_path, storage):
    async with seam(storage) as (_, _, plugins):
        assert await transfer_all(plugins) == [1] * ROWS
        assert await barrier(plugins[0], [1] * ROWS) == 1
        await assert_outputs(plugins)
        stats = [p.runs[SHUFFLE].statistics() for p in plugins]
        assert sum(s.outputs for s in stats) == COLUMNS
        assert all(s.bytes_received > 0 and s.bytes_sent > 0 for s in stats)


@pytest.mark.parametrize("storage", ["memory", "disk"])
@gen_test()
async def test_one_thread_cutting_input_after_input_keeps_each_batch_it_has_not_sent(
    seam, tmp_path, storage
):
    # each worker cuts its inputs one after the other into one buffer of its own; the
    # network holds every batch until all inputs are cut, so a batch that pointed into that
    # buffer would carry the last input's values
    async with seam(storage) as (_, network, plugins):
        network.hold = asyncio.Event()

        def cut_all(plugin, inputs):
            return [plugin.transfer_blocking(SHUFFLE, i, strided_chunk(i)) for i in inputs]

        n = len(plugins)
        done = await asyncio.gather(
            *(asyncio.to_thread(cut_all, p, range(k, ROWS, n)) for k, p in enumerate(plugins))
        )
        assert done == [[1] * (ROWS // n)] * n
        runs = [p.runs[SHUFFLE] for p in plugins]
        # no buffer was used again while a batch that views it waits to be delivered
        assert [r._cuts.made for r in runs] == [ROWS // n] * n
        network.hold.set()
        assert await barrier(plugins[0], [1] * ROWS) == 1
        assert [r._cuts.free for r in runs] == [0] * n  # let go at the barrier
        await assert_outputs(plugins)


@pytest.mark.parametrize("storage", ["memory", "disk"])
@gen_test()
async def test_a_cut_buffer_is_used_again_once_its_batches_were_delivered(seam, tmp_path, storage):
    with dask.config.set({"rechunk-p2p.comm.message-bytes-limit": 1}):  # send every batch
        async with seam(storage) as (_, _, plugins):
            a, b = plugins
            for i in range(ROWS):
                plugin = (a, b)[i % 2]
                await asyncio.to_thread(plugin.transfer_blocking, SHUFFLE, i, strided_chunk(i))
                cuts = plugin.runs[SHUFFLE]._cuts
                while not cuts.free:  # delivered: the buffer is back
                    await asyncio.sleep(0.001)
            assert [p.runs[SHUFFLE]._cuts.made for p in plugins] == [1, 1]
            assert await barrier(a, [1] * ROWS) == 1
            await assert_outputs(plugins)


@gen_test()
async def test_closing_the_last_run_after_the_offload_pool_stopped_gives_back_malloc(
    seam, tmp_path
):
    # the worker is closing: its pool stopped between freeing the store and the trim after
    # the last run; the run still closes, and malloc's thresholds are set back
    malloc = tuning_module.PROCESS_TUNING.malloc
    async with seam("memory") as (_, _, plugins):
        assert await transfer_all(plugins) == [1] * ROWS
        assert malloc.held == malloc.available
        runs = [p.runs[SHUFFLE] for p in plugins]
        for plugin, run in zip(plugins, runs, strict=True):
            hold = run._tuning
            release = hold.release

            def stop_pool_then_release(plugin=plugin, release=release):
                plugin.offload.shutdown()
                return release()

            hold.release = stop_pool_then_release
        assert [await run.close() for run in runs] == [True, True]
        assert not malloc.held
        tuning_module.PROCESS_TUNING.tidy_blocking()  # (the trim left to the next release)


@gen_test()
async def test_a_close_overtaking_the_run_reply_leaves_no_run(seam, tmp_path):
    async with seam("disk") as (scheduler, _, plugins):
        scheduler.gate = asyncio.Event()
        transfer = asyncio.ensure_future(
            asyncio.to_thread(plugins[0].transfer_blocking, SHUFFLE, 0, input_chunk(0))
        )
        while not scheduler.requests["a"]:
            await asyncio.sleep(0.001)
        scheduler.close(SHUFFLE, 1)  # the close arrives while the reply is on its way
        scheduler.gate.set()
        with pytest.raises(StaleRunError, match="closed before a joined it"):
            await transfer


@gen_test()
async def test_transient_send_errors_are_retried(seam, tmp_path):
    def fail_twice(sender: str, address: str, attempt: int) -> None:
        if attempt <= 2:
            raise OSError(f"injected failure {attempt} of {sender} -> {address}")

    with fast_retries():
        async with seam() as (_, network, plugins):
            network.fail = fail_twice
            await transfer_all(plugins)
            await barrier(plugins[0], [1] * ROWS)
            await assert_outputs(plugins)
            retries = [p.runs[SHUFFLE]._comm.statistics().retries for p in plugins]
            assert retries == [2, 2]


@gen_test()
async def test_errors_past_the_retry_count_fail_the_barrier_naming_the_peer(seam, tmp_path):
    def always(sender: str, address: str, attempt: int) -> None:
        raise ConnectionRefusedError("injected: nobody listens")

    with fast_retries(2):
        async with seam() as (_, network, plugins):
            network.fail = always
            # a transfer that starts after its worker's buffer failed raises the failure
            outcomes = await transfer_all(plugins, return_exceptions=True)
            assert all(o == 1 or isinstance(o, RechunkCommError) for o in outcomes), outcomes
            with pytest.raises(RechunkCommError, match=r"cannot deliver pieces .* at dp-"):
                await barrier(plugins[0], [1] * ROWS)
            assert max(network.attempts.values()) == 3  # the first try and two retries


@gen_test()
async def test_duplicate_deliveries_are_dropped(seam, tmp_path):
    async with seam("disk") as (_, network, plugins):
        network.copies = 2  # e.g. a retry after an ack was lost
        await transfer_all(plugins)
        await barrier(plugins[0], [1] * ROWS)
        await assert_outputs(plugins)
        # each worker receives 4 pieces (the other worker's rows) for each of its 2 outputs
        duplicates = [p.runs[SHUFFLE]._store.statistics().duplicates for p in plugins]
        assert duplicates == [8, 8]


@gen_test()
async def test_pieces_sent_to_the_wrong_worker_are_refused(seam, tmp_path):
    async with seam() as (_, network, plugins):
        network.misroute = {"dp-b": "dp-a"}  # a stale or wrong address of b's data plane
        # the refusal fails a's send buffer: a later transfer on b or the barrier raises it
        outcomes = await transfer_all(plugins, return_exceptions=True)
        try:
            outcomes.append(await barrier(plugins[0], [1] * ROWS))
        except RechunkRunError as e:
            outcomes.append(e)
        errors = [o for o in outcomes if isinstance(o, Exception)]
        assert errors and all(isinstance(e, RechunkRunError) for e in errors)
        assert all("reached a, which does not assemble" in str(e) for e in errors)
        assert isinstance(outcomes[-1], RechunkRunError)  # the barrier fails too
        assert plugins[0].runs[SHUFFLE]._store.statistics().outputs == 2  # a's only


@gen_test()
async def test_pieces_of_a_newer_run_open_it_and_of_an_older_run_are_refused(seam, tmp_path):
    async with seam() as (scheduler, _, plugins):
        a, b = plugins
        first = await asyncio.to_thread(a.get_run_blocking, SHUFFLE)
        assert first.run_id == 1
        scheduler.run_spec = make_run_spec(WORKERS, 2, "memory", ROWS, COLUMNS)  # restarted
        # b, already on run 2, sends to a, which still runs run 1: a moves on to run 2
        assert await asyncio.to_thread(b.transfer_blocking, SHUFFLE, 1, input_chunk(1)) == 2
        await barrier_flush(b, 2)
        assert a.runs[SHUFFLE].run_id == 2
        assert a.runs[SHUFFLE].statistics().bytes_received > 0
        assert first.statistics().phase == "closed"
        with pytest.raises(StaleRunError, match=r"Pieces for run 1 .* runs run 2"):
            await a.receive(SHUFFLE, 1, [])


async def barrier_flush(plugin, run_id: int) -> None:
    """One worker's part of the barrier, as the scheduler would ask for it."""
    checked(await plugin._worker_barrier(SHUFFLE, run_id))  # raises the worker's error


@gen_test()
async def test_a_barrier_of_a_replaced_run_is_replied_as_an_error(seam, tmp_path):
    async with seam(run_id=2) as (_, _, plugins):
        await asyncio.to_thread(plugins[0].get_run_blocking, SHUFFLE)
        reply = await plugins[0]._worker_barrier(SHUFFLE, 1)
        assert reply["status"] == "error"  # distributed's error reply, its error pickled
        with pytest.raises(StaleRunError, match=r"Barrier of run 1 .* runs run 2"):
            checked(reply)
        # and a barrier task whose transfers ran for an older run is rescheduled
        with pytest.raises(Reschedule):
            await barrier(plugins[0], [2] * (ROWS - 1) + [1])


@gen_test()
async def test_an_unpack_on_the_wrong_worker_pins_itself_to_the_owner(seam, tmp_path):
    async with seam() as (scheduler, _, plugins):
        owner = scheduler.run_spec.worker_for(0)
        elsewhere = next(p for p in plugins if p.worker.address != owner)
        with pytest.raises(Reschedule):
            await unpack(elsewhere, 0)
        assert scheduler.restricted == [(("out", 0, 0), owner)]
        with pytest.raises(Reschedule):  # an unpack task of a replaced run
            await unpack(elsewhere, 0, run_id=0)
        assert len(scheduler.restricted) == 1


@gen_test()
async def test_close_wakes_a_transfer_waiting_for_room_and_gives_every_byte_back(seam, tmp_path):
    async with seam() as (scheduler, network, plugins):
        a = plugins[0]
        a.dataplane.limiter.limit = 1  # one batch in the send buffer at a time
        network.hold = asyncio.Event()  # sends stay in flight
        await asyncio.to_thread(a.transfer_blocking, SHUFFLE, 0, input_chunk(0))
        waiting = asyncio.ensure_future(
            asyncio.to_thread(a.transfer_blocking, SHUFFLE, 2, input_chunk(2))
        )
        await asyncio.sleep(0.2)
        assert not waiting.done()  # held back: the buffer is full
        assert a.dataplane.limiter.used > 0
        scheduler.close(SHUFFLE, 1)
        with pytest.raises(StaleRunError):
            await asyncio.wait_for(waiting, 10)
        await asyncio.gather(*a._background)
        assert a.dataplane.limiter.used == 0


# --- a run continued after an owner left (the scheduler's _continue_without) ----------------

THREE_WORKERS = ("a", "b", "c")
SIX = 6  # outputs: two per worker


async def run_to_barrier(plugins) -> None:
    assert await transfer_all(plugins) == [1] * ROWS
    assert await barrier(plugins[0], [1] * ROWS) == 1


async def leave(scheduler, network, plugins, leaver: str):
    """``leaver`` is gone (its run closed, unreachable) and the scheduler continues the run
    as run 2. The plugins of the workers that stay."""
    gone = next(p for p in plugins if p.worker.address == leaver)
    gone._close_handler(SHUFFLE, 1, reason="killed")
    await asyncio.gather(*gone._background)
    del scheduler.plugins[leaver], network.planes[f"dp-{leaver}"]
    scheduler.run_spec = scheduler.run_spec.continued_without(leaver, 2)
    return [p for p in plugins if p is not gone]


@gen_test()
async def test_a_continued_run_rebuilds_only_the_moved_outputs(seam, tmp_path):
    async with seam("disk", workers=THREE_WORKERS, columns=SIX) as (scheduler, network, plugins):
        first = scheduler.run_spec
        await run_to_barrier(plugins)
        a, b = await leave(scheduler, network, plugins, "c")
        b_run = b.runs[SHUFFLE]
        before = sum(p.runs[SHUFFLE].statistics().bytes_received for p in (a, b))
        a._continue_handler(SHUFFLE, scheduler.run_spec, [])  # b has not heard of it yet
        assert a.runs[SHUFFLE].run_id == 2
        # a's transfers send only the moved outputs' pieces (staged: tiny ones go at a's
        # part of the barrier); b learns of run 2 from them
        assert await transfer_all([a]) == [2] * ROWS
        await barrier_flush(a, 2)
        assert b.runs[SHUFFLE] is b_run and b_run.run_id == 2  # continued, not replaced
        assert await barrier(a, [2] * ROWS) == 2
        by_address = {p.worker.address: p for p in (a, b)}
        for flat in range(SIX):
            owner = by_address[scheduler.run_spec.worker_for(flat)]
            np.testing.assert_array_equal(await unpack(owner, flat, 2), expected_output(flat, SIX))
        moved = sorted(scheduler.run_spec.moved)
        assert moved == [flat for flat in range(SIX) if first.worker_for(flat) == "c"]
        # what crossed again: every row's piece of b's share of the moved outputs
        resent = sum(p.runs[SHUFFLE].statistics().bytes_received for p in (a, b)) - before
        to_b = [f for f in moved if scheduler.run_spec.worker_for(f) == "b"]
        assert to_b and resent == len(to_b) * ROWS * 2 * 8  # 1 x 2 float64 pieces


@gen_test()
async def test_outputs_assembled_before_a_continuation_are_kept_for_it(seam, tmp_path):
    async with seam(workers=THREE_WORKERS, columns=SIX) as (scheduler, network, plugins):
        a_outputs = [f for f in range(SIX) if scheduler.run_spec.worker_for(f) == "a"]
        a = plugins[0]
        await run_to_barrier(plugins)
        done = await unpack(a, a_outputs[0])  # finished; its task is released by the scheduler
        run = a.runs[SHUFFLE]
        entered, release = threading.Event(), threading.Event()
        read = run._store.take_output_blocking  # the memory store fills outputs as pieces come

        def blocked_read(*args):
            entered.set()
            release.wait(10)
            return read(*args)

        run._store.take_output_blocking = blocked_read
        running = asyncio.ensure_future(unpack(a, a_outputs[1]))  # assembling as it continues
        await asyncio.to_thread(entered.wait, 10)
        a, _ = await leave(scheduler, network, plugins, "c")
        a._continue_handler(SHUFFLE, scheduler.run_spec, a_outputs)
        release.set()
        assembled = await running
        # run 2's tasks of the same outputs get the results; the store was read once each
        assert await unpack(a, a_outputs[0], 2) is done
        assert await unpack(a, a_outputs[1], 2) is assembled
        assert not run._results._kept
        # an output assembled before that was not kept: the scheduler hears which one, and
        # where (it continues the run to assemble it again elsewhere)
        run._results._assembled.add(a_outputs[0])
        with pytest.raises(Reschedule):
            await unpack(a, a_outputs[0], 2)
        assert scheduler.lost == [(2, a_outputs[0], a.worker.address)]
        assert "assembled on a before" in scheduler.restarts[0][1]


@gen_test()
async def test_an_owner_leaving_before_the_barrier_is_forgotten_and_only_its_pieces_resent(
    seam, tmp_path
):
    def c_is_gone(sender: str, address: str, attempt: int) -> None:
        if address == "dp-c":
            raise ConnectionRefusedError("injected: c was killed")

    # every input's pieces are sent at once (not staged until a message's worth is there)
    with fast_retries(1), dask.config.set({"rechunk-p2p.comm.message-bytes-limit": 1}):
        async with seam(workers=THREE_WORKERS, columns=SIX) as (scheduler, network, plugins):
            network.fail = c_is_gone
            a, b, c = plugins
            # the transfers finish before the sends to c fail (deliveries wait meanwhile:
            # else a slow transfer meets its buffer failed and raises)
            network.hold = asyncio.Event()
            assert await transfer_all(plugins) == [1] * ROWS  # c cuts inputs 2, 5
            network.hold.set()
            # a's and b's sends to c fail for good before they hear c is gone; c delivered
            # its own pieces to them before it went
            while any(p.runs[SHUFFLE]._comm.phase.value != "failed" for p in (a, b)):
                await asyncio.sleep(0.01)
            await c.runs[SHUFFLE]._comm.flush()
            survivors = await leave(scheduler, network, plugins, "c")
            # the scheduler: inputs c cut may have lost pieces: they are sent again in full;
            # the others only for c's outputs, which moved
            lost = frozenset(range(2, ROWS, 3))
            scheduler.run_spec = dataclasses.replace(scheduler.run_spec, resend_all=lost)
            for p in survivors:
                p._continue_handler(SHUFFLE, scheduler.run_spec, [])
            await asyncio.sleep(0.01)  # the buffers forget c on their loop
            assert [p.runs[SHUFFLE]._comm.phase.value for p in survivors] == ["sending"] * 2
            # what they kept for each other while failed is delivered now, not lost
            while any(p.runs[SHUFFLE]._comm._drainers for p in survivors):
                await asyncio.sleep(0.01)
            before = sum(p.runs[SHUFFLE].statistics().bytes_received for p in survivors)
            assert await transfer_all(survivors) == [2] * ROWS
            assert await barrier(a, [2] * ROWS) == 2
            spec = scheduler.run_spec
            by_address = {p.worker.address: p for p in survivors}
            for flat in range(SIX):
                out = await unpack(by_address[spec.worker_for(flat)], flat, 2)
                np.testing.assert_array_equal(out, expected_output(flat, SIX))

            # what crossed again: pieces of moved outputs (new to their owners), and the other
            # pieces of c's inputs (c had delivered them: dropped as duplicates); new bytes
            # crossed where the survivor that cut a piece does not own it
            def crossing(i: int, flat: int) -> bool:
                return spec.worker_for(flat) != survivors[i % 2].worker.address

            resent = sum(p.runs[SHUFFLE].statistics().bytes_received for p in survivors)
            moved = [(i, f) for i in range(ROWS) for f in spec.moved if crossing(i, f)]
            again = [(i, f) for i in lost for f in range(SIX) if f not in spec.moved]
            duplicates = sum(p.runs[SHUFFLE]._store.statistics().duplicates for p in survivors)
            assert resent - before == 16 * len(moved)  # 1 x 2 float64 pieces
            assert duplicates == len(again) > 0  # received or stored by their cutter


def test_a_task_on_a_closing_worker_does_not_install_the_plugin_again():
    from distributed.core import Status

    from rechunk_p2p.worker.install import plugin_for_task

    # the worker's plugins were taken down as it closes; a task that starts now fails at once
    # (installing would wait for a plugin that never comes, holding up the worker's close)
    worker = SimpleNamespace(plugins={}, status=Status.closing, address="tcp://w:1")
    with pytest.raises(StaleRunError, match="is closing"):
        plugin_for_task(worker)


@gen_test()
async def test_a_run_closed_while_a_transfer_cuts_is_stale_not_failed(seam, tmp_path):
    """The run closes (restarted elsewhere) between a transfer's check and its write to the
    run's store: the transfer raises StaleRunError, which the scheduler takes as a stale
    task, not the store's "closed" error, which failed the rechunk (seen once in the
    worker-loss benchmark)."""
    loop = asyncio.get_running_loop()
    async with seam("memory") as (_, _, plugins):
        a = plugins[0]
        await asyncio.to_thread(a.transfer_blocking, SHUFFLE, 0, input_chunk(0))
        run = a.runs[SHUFFLE]
        store = run._store
        write_packed, write = store.write_packed_blocking, store.write_blocking

        def close_first(write_fn):
            def closing(batch):
                asyncio.run_coroutine_threadsafe(run.close(), loop).result(10)
                return write_fn(batch)

            return closing

        store.write_packed_blocking = close_first(write_packed)
        store.write_blocking = close_first(write)
        with pytest.raises(StaleRunError, match="closed while input 2 was cut"):
            await asyncio.to_thread(a.transfer_blocking, SHUFFLE, 2, input_chunk(2))
