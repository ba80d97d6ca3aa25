"""``rechunk_p2p.install()``: routing dask's ``rechunk(method="p2p")`` through the engine.

distributed's own P2P rechunk also names its output ``rechunk-p2p-<token>``, so a graph is
recognised as the engine's by its barrier keys (``rechunk_p2p-barrier-...``) and by the runs
the scheduler plugin creates, not by the output name alone.
"""

from __future__ import annotations

import subprocess
import sys

import dask
import dask.array as da
import numpy as np
import pytest
import xarray as xr
from distributed.utils_test import gen_cluster

import rechunk_p2p
from rechunk_p2p.spec import BARRIER_PREFIX
from tests.conftest import assert_clean
from tests.engine_helpers import PLUGIN, TWO, check_result


def _dask_rechunk_module():
    return sys.modules["dask.array.rechunk"]


def is_engine_graph(y: da.Array) -> bool:
    """Whether ``y`` was built by rechunk_p2p (it has at least one sub-shuffle)."""
    keys = y.__dask_graph__().keys()
    return y.name.startswith("rechunk-p2p-") and any(
        isinstance(k, str) and k.startswith(BARRIER_PREFIX) for k in keys
    )


@pytest.fixture
def restore_routing():
    """Leave dask's rechunk as the test found it."""
    module = _dask_rechunk_module()
    before = module.rechunk
    package = sys.modules["dask.array"]
    before_package = package.rechunk
    was = rechunk_p2p.routing.is_installed()
    yield before
    rechunk_p2p.uninstall()
    if was:
        rechunk_p2p.install()
    assert module.rechunk is before
    assert package.rechunk is before_package


def test_uninstall_restores_the_exact_original(restore_routing):
    original = restore_routing
    module = _dask_rechunk_module()
    rechunk_p2p.install()
    assert module.rechunk is not original
    assert rechunk_p2p.routing.is_installed()
    rechunk_p2p.install()  # idempotent: the original is not replaced by the router
    rechunk_p2p.uninstall()
    assert module.rechunk is original
    assert not rechunk_p2p.routing.is_installed()
    rechunk_p2p.uninstall()  # idempotent
    assert module.rechunk is original


def test_installed_context_manager_restores(restore_routing):
    original = restore_routing
    module = _dask_rechunk_module()
    with rechunk_p2p.installed():
        assert module.rechunk is not original
        with rechunk_p2p.installed():  # nested: the outer block still routes afterwards
            pass
        assert rechunk_p2p.routing.is_installed()
    assert module.rechunk is original
    # already installed before the block: still installed after it
    rechunk_p2p.install()
    routed = module.rechunk
    with rechunk_p2p.installed():
        pass
    assert module.rechunk is routed
    rechunk_p2p.uninstall()
    assert module.rechunk is original
    # restored when the block raises
    with pytest.raises(ZeroDivisionError), rechunk_p2p.installed():
        raise ZeroDivisionError
    assert module.rechunk is original


def test_graphs_without_a_cluster(restore_routing):
    x = da.ones((12, 10), chunks=(1, 10))
    with rechunk_p2p.installed():
        assert is_engine_graph(x.rechunk((12, 2), method="p2p"))
        assert is_engine_graph(da.rechunk(x, (12, 2), method="p2p"))
        with dask.config.set({"array.rechunk.method": "p2p"}):
            assert is_engine_graph(x.rechunk((12, 2)))
            assert is_engine_graph(da.rechunk(x, (12, 2)))
            assert not is_engine_graph(x.rechunk((12, 2), method="tasks"))
        assert not is_engine_graph(x.rechunk((12, 2), method="tasks"))
        assert not is_engine_graph(x.rechunk((12, 2)))  # no method, no config: dask decides
        assert x.rechunk(x.chunks, method="p2p") is x
        # arguments reach the engine: balance and block_size_limit
        y = x.rechunk((12, 3), method="p2p", balance=True)
        assert y.chunks == x.rechunk((12, 3), method="tasks", balance=True).chunks
        y = x.rechunk({1: "auto"}, method="p2p", block_size_limit=16)
        assert y.chunks == x.rechunk({1: "auto"}, method="tasks", block_size_limit=16).chunks
    assert not is_engine_graph(x.rechunk((12, 2), method="tasks"))


IMPORT_CHANGES_NOTHING = """
import sys
import dask, dask.array as da
module = sys.modules["dask.array.rechunk"]
before = module.rechunk, da.rechunk, da.Array.rechunk
config = dask.config.get("array.rechunk.method", None)
import rechunk_p2p
assert (module.rechunk, da.rechunk, da.Array.rechunk) == before
assert module.rechunk is before[0] and da.rechunk is before[1]
assert dask.config.get("array.rechunk.method", None) == config
assert not rechunk_p2p.routing.is_installed()
x = da.ones((4, 4), chunks=(1, 4))
assert x.rechunk((4, 1), method="tasks").name.startswith("rechunk-merge")
print("unchanged")
"""


def test_importing_changes_nothing():
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHANGES_NOTHING],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "unchanged"


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_routed_rechunks_run_on_the_engine(c, s, a, b):
    await rechunk_p2p.register(c)
    plugin = s.plugins[PLUGIN]
    arr = np.arange(24 * 18).reshape(24, 18)
    x = da.from_array(arr, chunks=(2, 18))
    with rechunk_p2p.installed():
        by_method = x.rechunk((24, 3), method="p2p")
        assert is_engine_graph(by_method)
        before = plugin.runs_created
        check_result(await c.compute(by_method), arr)
        assert plugin.runs_created - before == 1
        with dask.config.set({"array.rechunk.method": "p2p"}):
            by_config = x.rechunk((3, 6))
        assert is_engine_graph(by_config)
        before = plugin.runs_created
        check_result(await c.compute(by_config), arr)
        assert plugin.runs_created - before == rechunk_p2p.plan(x, (3, 6)).n_shuffles > 0
        before = plugin.runs_created
        check_result(await c.compute(x.rechunk((24, 3), method="tasks")), arr)
        assert plugin.runs_created == before
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_xarray_chunk_routes_through_the_engine(c, s, a, b):
    await rechunk_p2p.register(c)
    plugin = s.plugins[PLUGIN]
    rng = np.random.default_rng(2)
    temperature = rng.random((12, 6, 8)).astype("f4")
    flag = rng.integers(0, 2, (12, 8)).astype(bool)
    ds = xr.Dataset(
        {
            "t": (("time", "lat", "lon"), temperature),
            "flag": (("time", "lon"), flag),
        },
        coords={"time": np.arange(12), "lat": np.linspace(-60, 60, 6), "lon": np.arange(8)},
        attrs={"title": "small"},
    ).chunk({"time": 1})
    assert ds["t"].data.chunks == ((1,) * 12, (6,), (8,))
    with rechunk_p2p.installed(), dask.config.set({"array.rechunk.method": "p2p"}):
        out = ds.chunk({"time": -1, "lon": 2})
    assert is_engine_graph(out["t"].data)
    assert is_engine_graph(out["flag"].data)
    assert out["t"].data.chunks == ((12,), (6,), (2, 2, 2, 2))
    assert out.attrs == ds.attrs
    before = plugin.runs_created
    computed = await c.compute(out)
    assert plugin.runs_created - before == 2
    np.testing.assert_array_equal(computed["t"].values, temperature)
    assert computed["t"].dtype == temperature.dtype
    np.testing.assert_array_equal(computed["flag"].values, flag)
    with dask.config.set(scheduler="sync"):
        xr.testing.assert_identical(computed, ds.compute())
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, allow_unclosed=False)
async def test_dask_own_choice_routes_with_no_config(c, s, a, b):
    """No method, no config, no register(): where dask itself would pick P2P (a distributed
    client and a large all-to-all rechunk), the engine runs; where it picks tasks, dask's
    tasks rechunk runs. xarray's .chunk() follows."""
    assert dask.config.get("array.rechunk.method", None) is None
    arr = np.arange(100 * 100.0).reshape(100, 100)
    x = da.from_array(arr, chunks=(100, 1))
    ds = xr.Dataset({"v": (("t", "y"), arr)}).chunk({"y": 1})
    with rechunk_p2p.installed():
        all_to_all = x.rechunk(((1,) * 100, (100,)))
        local = x.rechunk(((50, 50), (2,) * 50))  # dask picks tasks here
        out = ds.chunk({"t": 1, "y": -1})
    assert is_engine_graph(all_to_all)
    assert not is_engine_graph(local)
    assert is_engine_graph(out["v"].data)
    check_result(await c.compute(all_to_all), arr)
    check_result(await c.compute(local), arr)
    np.testing.assert_array_equal((await c.compute(out))["v"].values, arr)
    assert s.plugins[PLUGIN].runs_created == 2
    await assert_clean(s, a, b)
