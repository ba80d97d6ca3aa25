"""One memory budget per worker: the runs open there at once share it, and outputs that a
continuation moves to a worker spill where the budget has no room left for them."""

from __future__ import annotations

import asyncio
import contextlib
from unittest import mock

import dask.array as da
import numpy as np
import pytest
from distributed.core import Status
from distributed.utils_test import captured_logger, gen_cluster

import rechunk_p2p
from rechunk_p2p.spec import RunId
from rechunk_p2p.store import AssemblingMemoryStore, DiskPieceStore, SplitStore
from rechunk_p2p.worker.memory_shares import MemoryShares, RunMemory
from rechunk_p2p.worker.storage_choice import resolve_storage
from tests.conftest import assert_clean
from tests.engine_helpers import PLUGIN, THREE, TWO, check_result
from tests.test_worker_leaves import (
    _rechunk,
    _run_once_active,
    _slow,
    retire_an_owner_once_it_transferred,
)
from tests.worker_fakes import make_run_spec

A, B = "tcp://a:1", "tcp://b:1"
#: one output of make_run_spec's default: 8 rows x 3 columns of float64
OUTPUT = 8 * 3 * 8


@pytest.mark.parametrize(
    ("room", "kind", "in_memory", "reserved"),
    [
        (None, "memory", None, 0),
        (2 * OUTPUT, "memory", None, 2 * OUTPUT),
        (1.5 * OUTPUT, "memory+disk", [True, False, False, False], OUTPUT),
        (OUTPUT - 1, "disk", None, 0),
    ],
)
def test_a_run_keeps_in_memory_what_the_room_left_holds(room, kind, in_memory, reserved):
    """A takes outputs 0 and 1 of 4; whatever the budget has left decides."""
    choice = resolve_storage(make_run_spec((A, B), storage="auto"), A, room)
    assert (choice.kind, choice.reserved) == (kind, reserved)
    if in_memory is None:
        assert choice.in_memory is None
    else:
        assert choice.in_memory.tolist() == in_memory


def test_a_worker_outside_the_run_reserves_nothing():
    choice = resolve_storage(make_run_spec((A, B), storage="auto"), "tcp://c:1", 0)
    assert (choice.kind, choice.reserved) == ("memory", 0)


def test_runs_share_one_budget_and_give_it_back():
    shares = MemoryShares()
    first, second = (RunMemory(shares, 1000, _no_spill) for _ in range(2))
    first.reserve(600)
    assert shares.available(1000) == 400
    second.reserve(700)  # (a continuation's outputs are asked for before they reserve)
    assert shares.available(1000) == 0
    first.release()
    first.release()
    assert (shares.reserved, len(shares)) == (700, 1)
    assert shares.available(None) is None


def _no_spill() -> DiskPieceStore:
    raise AssertionError("nothing should spill")


def _pieces(flat_outputs, inputs=range(8)):
    """Row ``i`` of output ``o`` (3 columns), every element unique."""
    return [(o, i, np.full((1, 3), o * 100 + i, dtype="f8")) for o in flat_outputs for i in inputs]


@pytest.mark.parametrize("split_first", [False, True])
def test_moved_outputs_past_the_budget_spill_and_the_others_stay(tmp_path, split_first):
    """A held outputs 0 and 1 in memory; B left and its outputs 2 and 3 move to A, whose
    budget has room for one more: 2 is filled in memory, 3 spills; every output reads back
    whole, from where it was put."""
    before = make_run_spec((A, B), storage="auto")
    after = before.continued_without(B, RunId(2), frozenset(range(8)))
    partial = before.spec.partial
    memory = AssemblingMemoryStore(np.dtype("f8"), "s", partial)
    spilled: list[DiskPieceStore] = []

    def spill() -> DiskPieceStore:
        spilled.append(DiskPieceStore(np.dtype("f8"), tmp_path, "s"))
        return spilled[-1]

    shares = MemoryShares()
    run = RunMemory(shares, 3 * OUTPUT, spill)
    run.reserve(2 * OUTPUT)
    store = memory
    if split_first:  # a run that spilled from its start: the split store gains the outputs
        store = SplitStore(memory, spill(), np.array([True, True, False, False]))
    taken = run.take_moved(store, after, [2, 3])
    assert isinstance(taken, SplitStore) and len(spilled) == 1
    assert [taken.holds_in_memory(o) for o in range(4)] == [True, True, True, False]
    assert shares.reserved == 3 * OUTPUT
    taken.write_blocking(_pieces(range(4)))
    for o in range(3):
        out, missing = taken.take_output_blocking(o)
        assert missing == [] and (out[:, 0] == o * 100 + np.arange(8)).all()
    assert sorted(i for i, _ in taken.read_blocking(3)) == list(range(8))
    assert taken.statistics().bytes_spilled == OUTPUT
    taken.close_blocking()


def test_moved_outputs_within_the_budget_stay_in_the_store():
    before = make_run_spec((A, B), storage="auto")
    after = before.continued_without(B, RunId(2), frozenset())
    store = AssemblingMemoryStore(np.dtype("f8"), "s", before.spec.partial)
    run = RunMemory(MemoryShares(), None, _no_spill)  # no memory limit
    assert run.take_moved(store, after, [2, 3]) is store
    store.close_blocking()


def _max_reserved(workers) -> dict:
    """Record the most each worker's runs reserved at once."""
    peaks = {}
    for worker in workers:
        shares = worker.plugins[PLUGIN].shares
        reserve = shares.reserve

        def recorded(run, nbytes, shares=shares, reserve=reserve, address=worker.address):
            reserve(run, nbytes)
            peaks[address] = max(peaks.get(address, 0), shares.reserved)

        shares.reserve = recorded
    return peaks


def _most_runs_open(workers) -> dict:
    """Record the most runs each worker had open at once."""
    most: dict[str, int] = {}
    for worker in workers:
        plugin = worker.plugins[PLUGIN]
        new_run = plugin._new_run

        def counted(run_spec, plugin=plugin, new_run=new_run, address=worker.address):
            run = new_run(run_spec)
            most[address] = max(most.get(address, 0), len(plugin.runs) + 1)
            return run

        plugin._new_run = counted
    return most


#: 40 x 30 int64 into 10 column blocks: 4,800 bytes a worker per variable on 2 workers
_SHARE = 40 * 30 * 8 // 2


@gen_cluster(
    client=True,
    nthreads=TWO,
    worker_kwargs={"memory_limit": "1GiB"},
    config={"rechunk-p2p.storage-memory-fraction": 1.5 * _SHARE / 2**30},
)
async def test_runs_open_at_once_share_the_workers_budget(c, s, a, b):
    """Three variables rechunked in one computation, as a Dataset's are: two or three runs
    open at once on each worker, whose budget holds one and a half of their shares.
    Together they never reserve more than the budget; what does not fit spills (a run
    opened beside another spills at least the half share the budget lacks for it); the
    values are right."""
    await rechunk_p2p.register(c)
    peaks = _max_reserved([a, b])
    open_at_once = _most_runs_open([a, b])
    arrays = [np.arange(40 * 30).reshape(40, 30) + k for k in range(3)]
    ys = [
        rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 30)).map_blocks(_slow), (40, 3))
        for arr in arrays
    ]
    results = await c.gather(c.compute(ys))
    for result, arr in zip(results, arrays):
        check_result(result, arr)
    assert min(open_at_once.values()) >= 2, open_at_once  # (else nothing shared the budget)
    budget = 1.5 * _SHARE
    assert peaks and all(0 < peak <= budget for peak in peaks.values()), peaks
    # each run alone fits the budget: only runs open at once spill
    spilled = [w.plugins[PLUGIN].totals().bytes_spilled for w in (a, b)]
    assert all(n >= _SHARE - (budget - _SHARE) for n in spilled), spilled
    await assert_clean(s, a, b)


@gen_cluster(
    client=True,
    nthreads=THREE,
    worker_kwargs={"memory_limit": "1GiB"},
    config={"rechunk-p2p.storage-memory-fraction": 2.5 * 60 * 10 * 8 / 2**30},
)
async def test_outputs_moved_by_a_continuation_spill_past_the_budget(c, s, *workers):
    """Each of three workers assembles 2 of 6 column blocks (60 x 10 float64, 4,800 bytes
    each), in memory, within a budget of two and a half blocks' bytes. An owner retires
    mid-transfer: each survivor takes one of its blocks, which does not fit what its budget
    has left and spills, and the result is right."""
    await rechunk_p2p.register(c)
    peaks = _max_reserved(workers)
    y, arr = _rechunk(n_outputs=6)  # (storage: auto, the default)
    future = c.compute(y)
    owner = await retire_an_owner_once_it_transferred(c, s, workers)
    check_result(await asyncio.wait_for(future, 60), arr)
    plugin = s.plugins[PLUGIN]
    assert (
        plugin.recovery.counts.continuations,
        plugin.recovery.counts.restarts,
        plugin.recovery.counts.outputs_moved,
    ) == (1, 0, 2)
    survivors = [w for w in workers if w.address != owner]
    block = 60 * 10 * 8
    assert [peaks[w.address] for w in survivors] == [2 * block, 2 * block], peaks
    spilled = [w.plugins[PLUGIN].totals().bytes_spilled for w in survivors]
    assert spilled == [block, block]
    await assert_clean(s, *survivors)


@contextlib.contextmanager
def _patched_watch():
    """The stall watch's waits cut to seconds."""
    from rechunk_p2p import stalls

    with (
        mock.patch.object(stalls, "MOVE_SECONDS", 0.5),
        mock.patch.object(stalls, "LOG_SECONDS", 0.5),
        mock.patch.object(stalls, "GIVE_UP_SECONDS", 3.0),
    ):
        yield


async def _paused_mid_transfer(c, s, worker):
    """A rechunk whose transfers are running when ``worker`` is paused; its future, run,
    and the array."""
    await rechunk_p2p.register(c)
    arr = np.arange(60 * 60, dtype="f8").reshape(60, 60)
    x = da.from_array(arr, chunks=(1, 60)).map_blocks(_slow)
    future = c.compute(rechunk_p2p.rechunk(x, (60, 10)))
    run = await _run_once_active(s)
    while not worker.state.executed_count:
        await asyncio.sleep(0.005)
    worker.status = Status.paused  # as distributed's memory monitor pauses it
    return future, run, arr


# (distributed's memory monitor would resume the workers paused below at its next look)
@gen_cluster(client=True, nthreads=TWO, config={"distributed.worker.memory.pause": False})
async def test_outputs_pinned_to_a_paused_worker_fail_with_its_name_and_memory(c, s, a, b):
    """A worker that distributed pauses runs none of the tasks it was given nor the outputs
    pinned to it. Its transfers go to the running worker; its outputs wait, named in the
    scheduler's log, and then fail with one line naming the worker, its status and its
    memory; nothing stays behind once the worker resumes."""

    with _patched_watch():
        future, run, _ = await _paused_mid_transfer(c, s, b)
        with pytest.raises(rechunk_p2p.RechunkStalledError) as info:
            await asyncio.wait_for(future, 60)
    message = str(info.value)
    assert "\n" not in message
    assert f"worker {b.address}, which is paused (process memory" in message
    assert f"Rechunk {run.shuffle_id}" in message and "gave up" in message
    watch = s.plugins[PLUGIN].stalls
    assert watch.failed == 1 and watch.moved > 0
    b.status = Status.running
    del future
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, config={"distributed.worker.memory.pause": False})
async def test_a_worker_paused_for_a_while_holds_the_rechunk_up_only_that_long(c, s, a, b):
    """Paused past the log's wait and resumed before the give-up: the wait is logged, the
    rechunk finishes, its values right."""
    with _patched_watch(), captured_logger("rechunk_p2p.scheduler") as log:
        future, _, arr = await _paused_mid_transfer(c, s, b)
        while "has waited" not in log.getvalue():
            await asyncio.sleep(0.05)
        b.status = Status.running
        check_result(await asyncio.wait_for(future, 60), arr)
    assert f"worker {b.address}, which is paused" in log.getvalue()
    assert s.plugins[PLUGIN].stalls.failed == 0
    del future
    await assert_clean(s, a, b)


def test_a_stall_is_described_in_one_line():
    from rechunk_p2p.stalls import HeldBy, Stall

    stall = Stall(
        "abc-0.0",
        7,
        12.4,
        (HeldBy("tcp://w:1", "paused", 24, int(2.63 * 2**30), 3 * 2**30),),
        (),
        "open_dataset-t2m",
    )
    assert stall.describe() == (
        "Rechunk abc-0.0 (open_dataset-t2m, run 7) has waited 12 s: 24 output tasks wait "
        "for worker tcp://w:1, which is paused (process memory 2.63 GiB of its 3.00 GiB limit)"
    )


@pytest.mark.parametrize(
    ("limit", "send", "disk"),
    [
        (None, 256 * 2**20, 64 * 2**20),  # no memory limit: the settings as they are
        (4 * 2**30, 256 * 2**20, 64 * 2**20),
        (512 * 2**20, 128 * 2**20, 32 * 2**20),
        (4 * 2**20, 2 * 2**20, 256 * 2**10),  # (a send buffer holds one message at least)
    ],
)
def test_the_engines_buffers_stay_within_a_share_of_the_memory_limit(limit, send, disk):
    from rechunk_p2p.settings import WorkerSettings

    settings = WorkerSettings.read()
    assert settings.send_buffer_bytes(limit) == send
    assert settings.disk_buffer_bytes(limit) == disk
    if limit:  # pieces in memory, the send buffer and three runs' disk buffers
        engine = settings.memory_budget(limit) + send + 3 * disk
        assert engine < 0.8 * limit or limit < 64 * 2**20


@gen_cluster(client=True, nthreads=TWO, worker_kwargs={"memory_limit": "512MiB"})
async def test_a_small_workers_send_buffer_is_a_quarter_of_its_memory(c, s, a, b):
    await rechunk_p2p.register(c)
    assert [w.plugins[PLUGIN].dataplane.limiter.limit for w in (a, b)] == [128 * 2**20] * 2
