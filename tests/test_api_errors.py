"""Errors of ``rechunk_p2p.rechunk`` and ``plan``: raised on the client, before anything runs.

Each bad request is made against a live cluster, which must see no task and no run because
of it. Errors derive from :class:`rechunk_p2p.RechunkP2PError` and from the builtin a user
would catch.
"""

from __future__ import annotations

import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p import ClusterError, RechunkP2PError
from tests.conftest import assert_clean
from tests.engine_helpers import PLUGIN, TWO, check_result


def _square():
    return da.ones((10, 10), chunks=5)


def _unknown_sizes():
    x = da.from_array(np.arange(20), chunks=5)
    return x[x > 3]


# (make the array, chunks, exception type, a phrase of the message)
BAD_REQUESTS = [
    (lambda: np.ones((4, 4)), (2, 2), TypeError, "dask array"),
    (lambda: [[1, 2], [3, 4]], (1, 1), TypeError, "from_array"),
    (_unknown_sizes, 3, ValueError, "compute_chunk_sizes()"),
    (lambda: _unknown_sizes()[:, None] * da.ones((1, 4)), (-1, 2), ValueError, "compute_chunk"),
    (_square, (5,), ValueError, "dimension"),
    (_square, ((5, 5),), ValueError, "dimension"),
    (_square, ((5, 4), (5, 5)), ValueError, "shape"),
    (_square, ((5, 6), (10,)), ValueError, "shape"),
    (_square, {0: (3, 3)}, ValueError, "shape"),
    (_square, {2: 3}, ValueError, "2"),
    (_square, {"x": 3}, (ValueError, TypeError), "x"),
    (_square, "not-a-size", ValueError, "not-a-size"),
]


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_bad_requests_fail_before_anything_runs(c, s, a, b):
    await rechunk_p2p.register(c)
    for make, chunks, error, phrase in BAD_REQUESTS:
        x = make()
        for attempt in (rechunk_p2p.rechunk, rechunk_p2p.plan):
            with pytest.raises(error) as info:
                attempt(x, chunks)
            assert isinstance(info.value, RechunkP2PError), (chunks, repr(info.value))
            assert phrase in str(info.value), (chunks, str(info.value))
    assert not s.tasks
    assert s.plugins[PLUGIN].runs_created == 0
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_unknown_storage_setting(c, s, a, b):
    await rechunk_p2p.register(c)
    x = da.from_array(np.arange(100).reshape(10, 10), chunks=(1, 10))
    for bad in ("tape", "DISK", None, 1):
        with dask.config.set({"rechunk-p2p.storage": bad}):
            with pytest.raises(ValueError, match=r"rechunk-p2p\.storage") as info:
                rechunk_p2p.rechunk(x, (10, 1))
            assert isinstance(info.value, RechunkP2PError)
            assert "disk" in str(info.value) and "memory" in str(info.value)
            assert rechunk_p2p.rechunk(x, x.chunks) is x  # nothing to do: no storage needed
    assert not s.tasks
    check_result(await c.compute(rechunk_p2p.rechunk(x, (10, 1))), np.arange(100).reshape(10, 10))
    await assert_clean(s, a, b)


def test_a_removed_setting_still_set_warns_once_and_is_ignored():
    """No cluster: the warning comes when a rechunk is planned (and when a worker starts)."""
    from rechunk_p2p import config

    x = da.from_array(np.arange(100).reshape(10, 10), chunks=(1, 10))
    config._warned.discard("partial-outputs")
    with dask.config.set({"rechunk-p2p.partial-outputs": 4}):
        with pytest.warns(FutureWarning, match=r"^rechunk-p2p\.partial-outputs is no longer"):
            plan = rechunk_p2p.plan(x, (10, 1))
        assert plan.n_partials == 1  # ignored
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rechunk_p2p.plan(x, (10, 1))  # once


@pytest.mark.parametrize(
    ("side", "key", "value", "message"),
    [
        ("worker", "comm.concurrency", 0, "> 0"),
        ("worker", "dataplane.connections", 0, "> 0"),
        ("worker", "comm.timeout", "soon", "is 'soon'; give a duration"),
        ("worker", "process-tuning", "yes", "give true or false"),
        ("worker", "disk-write-buffer-bytes", "-1MiB", "give a size >= 0"),
        ("worker", "storage-memory-fraction", 1.5, r"give a number in \(0, 1\]"),
        ("worker", "storage-memory-fraction", "half", r"give a number in \(0, 1\]"),
        ("worker", "disk-direct-io", "sometimes", "choose one of auto, true, false"),
        ("client", "storage", "tape", "choose one of disk, memory, auto"),
        ("client", "partial-bytes", "-1", "give a size >= 0"),
        ("client", "transfer-group-bytes", "lots", "lots"),
        ("client", "comm.run-buffer-bytes", "0B", "give a positive size or null"),
        ("scheduler", "scheduler.assign-transfers", -1, "whole number"),
        ("scheduler", "process-tuning", "on", "give true or false"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key(side, key, value, message):
    """No cluster: each side reads its settings into one object, checked as it reads them."""
    from rechunk_p2p.settings import ClientSettings, SchedulerSettings, WorkerSettings

    read = {"worker": WorkerSettings, "client": ClientSettings, "scheduler": SchedulerSettings}
    pattern = rf"rechunk-p2p\.{key}.*{message}"
    with (
        dask.config.set({f"rechunk-p2p.{key}": value}),
        pytest.raises(RechunkP2PError, match=pattern) as info,
    ):
        read[side].read()
    assert "\n" not in str(info.value)


def test_a_bad_client_setting_fails_a_rechunk_before_any_graph():
    x = da.ones((8, 8), chunks=(1, 8))
    with (
        dask.config.set({"rechunk-p2p.partial-bytes": "-5"}),
        pytest.raises(RechunkP2PError, match=r"^rechunk-p2p\.partial-bytes is '-5'"),
    ):
        rechunk_p2p.rechunk(x, (8, 1))


def test_the_settings_read_are_the_defaults_and_what_is_set():
    from rechunk_p2p.settings import ClientSettings, SchedulerSettings, WorkerSettings

    assert ClientSettings.read() == ClientSettings("auto", 64 * 2**20, 16 * 2**20, None)
    assert SchedulerSettings.read() == SchedulerSettings(512, True)
    worker = WorkerSettings.read()
    assert (worker.storage_memory_fraction, worker.direct_io) == (0.25, None)
    assert worker.connections == 512
    assert worker.memory_budget(4000) == 1000 and worker.memory_budget(None) is None
    with dask.config.set({"rechunk-p2p.comm.run-buffer-bytes": "8MiB"}):
        assert ClientSettings.read(storage="disk").run_buffer_bytes == 8 * 2**20
        assert ClientSettings.read(storage="disk").storage == "disk"


def test_extra_entries_are_ignored_like_dask():
    x = _square()
    for chunks in [(5, 2, 7), ((5, 5), (2, 8), (1,))]:
        assert rechunk_p2p.rechunk(x, chunks).chunks == x.rechunk(chunks, method="tasks").chunks


def test_unchanged_unknown_sizes_return_the_input():
    y = _unknown_sizes()
    assert rechunk_p2p.rechunk(y, y.chunks) is y
    assert rechunk_p2p.rechunk(y, {0: None}) is y


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_asynchronous_client_needs_no_register(c, s, a, b):
    """An asynchronous client that never called register(): the first task installs the
    scheduler plugin, which installs the worker plugin everywhere; nothing is left behind."""
    assert PLUGIN not in s.plugins
    x = da.from_array(np.arange(100).reshape(10, 10), chunks=(1, 10))
    y = rechunk_p2p.rechunk(x, (10, 1))
    check_result(await c.compute(y), np.arange(100).reshape(10, 10))
    assert PLUGIN in s.plugins
    assert PLUGIN in a.plugins and PLUGIN in b.plugins
    assert s.plugins[PLUGIN].runs_created == 1
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_scheduler_refusing_plugins_is_a_cluster_error(c, s, a, b):
    """A scheduler that refuses plugins (injected): the first transfer says what to do."""

    async def refuse(*args, **kwargs):
        raise PermissionError("plugins are not allowed here")

    s.handlers["register_scheduler_plugin"] = refuse
    x = da.from_array(np.arange(100).reshape(10, 10), chunks=(1, 10))
    y = rechunk_p2p.rechunk(x, (10, 1))
    with pytest.raises(ClusterError, match="register"):
        await c.compute(y)
    assert PLUGIN not in s.plugins
    await assert_clean(s, a, b)


@pytest.mark.parametrize(
    ("chunks", "axis", "size"),
    [(0, 0, 0), (-5, 0, -5), ((5, 0), 1, 0), ({0: -3}, 0, -3), ((None, -2), 1, -2)],
)
def test_zero_or_negative_chunk_sizes_are_one_line_value_errors(chunks, axis, size):
    x = da.ones((10, 10), chunks=5)
    with pytest.raises(ValueError, match=rf"^Chunk size {size} along axis {axis} \(length 10\)"):
        rechunk_p2p.rechunk(x, chunks)
    with pytest.raises(ValueError, match="is not a positive size"):
        rechunk_p2p.plan(x, chunks)


def test_long_chunk_specs_are_cut_in_messages():
    x = da.ones((10, 10), chunks=5)
    with pytest.raises(ValueError) as info:
        rechunk_p2p.rechunk(x, ((1,) * 3000, 5))
    assert len(str(info.value)) < 900
