"""A worker that distributed pauses moves its runs' pieces from memory to disk, while the
threads that write and read the store wait, and keeps no more in memory until it resumes."""

from __future__ import annotations

import asyncio
import threading

import dask
import dask.array as da
import numpy as np
import pytest
from distributed.core import Status
from distributed.utils_test import captured_logger, gen_cluster

import rechunk_p2p
from rechunk_p2p.worker.store_gate import StoreGate
from tests.conftest import assert_clean
from tests.engine_helpers import PLUGIN, TWO, check_result
from tests.test_worker_leaves import _run_once_active, _slow


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_sole_user_waits_for_the_users_begun_and_holds_new_ones_back():
    gate = StoreGate()
    events: list[str] = []
    inside, leave = threading.Event(), threading.Event()

    def user(name: str, hold: threading.Event | None = None) -> None:
        with gate.shared():
            events.append(f"{name} in")
            if hold is not None:
                inside.set()
                assert hold.wait(10)
            events.append(f"{name} out")

    def sole() -> None:
        with gate.sole():
            events.append("sole")

    first = _in_thread(lambda: user("first", leave))
    assert inside.wait(10)
    moving = _in_thread(sole)
    while "sole" not in events and not gate._sole:  # (waiting for the first user)
        threading.Event().wait(0.001)
    late = _in_thread(lambda: user("late"))
    threading.Event().wait(0.05)
    assert events == ["first in"]  # the sole user waits, and so does the late one
    leave.set()
    for thread in (first, moving, late):
        thread.join(10)
    assert events == ["first in", "first out", "sole", "late in", "late out"]


def test_users_share_the_gate():
    gate = StoreGate()
    both = threading.Barrier(2, timeout=10)

    def user() -> None:
        with gate.shared():
            both.wait()  # (fails unless both are inside at once)

    threads = [_in_thread(user) for _ in range(2)]
    for thread in threads:
        thread.join(10)
    assert not both.broken


# (distributed's memory monitor would resume the worker paused below at its next look)
@pytest.mark.parametrize("storage", ["auto", "memory"])
@gen_cluster(client=True, nthreads=TWO, config={"distributed.worker.memory.pause": False})
async def test_a_paused_worker_moves_its_pieces_to_disk_and_the_values_stay(c, s, a, b, storage):
    """Paused mid-transfer, a worker moves the pieces its run holds in memory to disk (its
    store splits, its share of the budget is given back, a warning names it); it resumes,
    the rechunk finishes from those pieces, its values right, no file left."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    x = da.from_array(arr, chunks=(1, 60)).map_blocks(_slow)
    with captured_logger("rechunk_p2p.worker.pressure") as log:
        with dask.config.set({"rechunk-p2p.storage": storage}):
            future = c.compute(rechunk_p2p.rechunk(x, (60, 10)))
        await _run_once_active(s)
        plugin = b.plugins[PLUGIN]
        while not plugin.run_statistics() or not plugin.run_statistics()[0].bytes_buffered:
            await asyncio.sleep(0.005)
        (run,) = plugin.open_runs()
        assert run.storage == "memory"
        b.status = Status.paused  # as distributed's memory monitor pauses it
        while not plugin.pressure.moved:
            await asyncio.sleep(0.01)
        assert plugin.shares.pressed and plugin.shares.reserved == 0
        assert run.storage == "memory+disk"
        assert run.statistics().bytes_spilled >= plugin.pressure.moved > 0
        b.status = Status.running
        check_result(await asyncio.wait_for(future, 60), arr)
    assert f"{b.address} is paused (short of memory): moved" in log.getvalue()
    assert not plugin.shares.pressed
    del future
    await assert_clean(s, a, b)


def test_pieces_written_from_threads_around_a_spill_all_arrive(tmp_path):
    """Four threads write a rechunk's pieces through the gate while a fifth moves the store
    to disk midway: every output is whole, each piece once."""
    from rechunk_p2p.store import SplitStore, make_store
    from tests.store.test_assembling_store import _expected, _partial, _pieces

    partial = _partial((64, 16, 16), (1, 16, 16), (64, 4, 4))  # 16 outputs of 64 inputs
    data = np.random.default_rng(0).random((64, 16, 16)).astype("f4")
    pieces = _pieces(partial, data)
    store = make_store(
        "memory+disk",
        dtype=data.dtype,
        directory=tmp_path / "spill",
        name="gate-test",
        buffer_bytes=4096,
        partial=partial,
        in_memory=np.ones(partial.n_outputs, dtype=bool),
    )
    assert isinstance(store, SplitStore)
    gate, halfway = StoreGate(), threading.Barrier(5, timeout=30)
    moved: list[int] = []

    def writer(k: int) -> None:
        mine = pieces[k::4]
        for i, piece in enumerate(mine):
            if i == len(mine) // 2:
                halfway.wait()
            with gate.shared():
                store.write_blocking([piece])

    def spill() -> None:
        halfway.wait()
        with gate.sole():
            moved.append(store.spill_blocking())

    threads = [_in_thread(lambda k=k: writer(k)) for k in range(4)] + [_in_thread(spill)]
    for thread in threads:
        thread.join(60)
    assert moved and moved[0] > 0
    stats = store.statistics()
    assert (stats.pieces, stats.duplicates) == (len(pieces), 0)
    for flat in range(partial.n_outputs):
        out = np.empty(partial.output_shape(flat), dtype=data.dtype)
        got = store.read_into_blocking(flat, out, dict(partial.pieces_of_output(flat)))
        assert sorted(got) == list(range(partial.n_inputs))
        assert np.array_equal(out, _expected(partial, data, flat))
    store.close_blocking()
