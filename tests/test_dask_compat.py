"""dask's own rechunk test-suite, run through the P2P engine, and checks it does not cover.

Where it runs: the pytest process, against one in-process ``LocalCluster`` (two single-thread
workers) shared by the module.

Every ``test_*`` function of ``dask.array.tests.test_rechunk`` (from the installed dask) is
imported into this module and run with :func:`rechunk_p2p.install` in effect,
``array.rechunk.method: p2p`` set and a distributed client active, so ``x.rechunk(...)`` and
the suite's own ``rechunk(...)`` go through :func:`rechunk_p2p.rechunk`. Tests of dask's tasks
algorithm itself (``plan_rechunk``, ``intersect_chunks``, ``old_to_new``, ``_breakpoints``, ...)
do not route here and run unchanged. Nothing is deselected. dask's tests that need
``dask.dataframe`` skip themselves when pyarrow is missing (the test extras install it).

The tests below the import compare the engine with ``method="tasks"`` where the suite is thin:
``threshold`` and ``block_size_limit``, ``"auto"`` for many dtypes, ``balance=True``, arrays of
unknown chunk sizes (without dask.dataframe), graphs computed without distributed workers.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import rechunk_p2p
import rechunk_p2p.arrays
from rechunk_p2p.spec import BARRIER_PREFIX
from tests.conftest import assert_clean_sync

dask_suite = pytest.importorskip("dask.array.tests.test_rechunk")

#: Tests of dask's suite that are not run here, with the reason: none. Every test of the
#: suite runs; those of dask's tasks algorithm itself do not route here and run unchanged.
DESELECTED: dict[str, str] = {}


def _import_suite() -> list[str]:
    """Bind every selected ``test_*`` of dask's suite as a global of this module."""
    names = []
    for name, obj in vars(dask_suite).items():
        if name.startswith("test_") and callable(obj) and name not in DESELECTED:
            globals()[name] = obj
            names.append(name)
    return names


SUITE_TESTS = _import_suite()


@pytest.fixture(scope="module")
def p2p_client():
    """A client of a small in-process cluster, the default client while the module runs."""
    with (
        LocalCluster(
            processes=False, n_workers=2, threads_per_worker=1, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


@pytest.fixture(autouse=True)
def engine_calls(p2p_client, monkeypatch):
    """Route every rechunk of the test through the engine; check nothing is left behind.

    Yields the list of arrays the engine was called with.
    """
    calls: list[da.Array] = []
    engine = rechunk_p2p.arrays.rechunk_array

    def spy(x, *args, **kwargs):
        calls.append(x)
        return engine(x, *args, **kwargs)

    monkeypatch.setattr(rechunk_p2p.arrays, "rechunk_array", spy)
    with rechunk_p2p.installed(), dask.config.set({"array.rechunk.method": "p2p"}):
        # dask's suite bound ``rechunk`` at import time, before the routing was installed.
        # (``dask.array.rechunk`` the attribute is the function; the module is in sys.modules.)
        monkeypatch.setattr(dask_suite, "rechunk", sys.modules["dask.array.rechunk"].rechunk)
        yield calls
    assert_clean_sync(p2p_client)


def _tasks(x, chunks="auto", **kwargs):
    """dask's own result, bypassing the engine."""
    return x.rechunk(chunks, method="tasks", **kwargs)


def _outcome(fn):
    """``("ok", chunks)`` or ``("error", exception)`` of ``fn()``, with its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ("ok", fn().chunks)
        except Exception as e:
            result = ("error", e)
    return result, sorted(str(w.message) for w in caught)


def _assert_same_outcome(x, chunks, **kwargs):
    """The engine gives dask's chunks, warnings and (a subclass of) dask's error."""
    (kind, ours), our_warnings = _outcome(lambda: x.rechunk(chunks, **kwargs))
    (their_kind, theirs), their_warnings = _outcome(lambda: _tasks(x, chunks, **kwargs))
    case = f"{x.shape} {x.dtype} chunks={x.chunks} -> {chunks!r} {kwargs}"
    assert kind == their_kind, f"{case}: engine {ours!r}, dask {theirs!r}"
    if kind == "ok":
        assert ours == theirs, case
    else:
        assert isinstance(ours, type(theirs)), case
        assert str(theirs) in str(ours), case
    assert our_warnings == their_warnings, case
    return kind, ours


# --- the import itself -------------------------------------------------------------------


def test_suite_is_collected():
    """The import found dask's suite, tests that route through the engine included."""
    assert len(SUITE_TESTS) > 50
    routed = {"test_rechunk_2d", "test_rechunk_with_dict", "test_balance_basics"}
    assert routed <= set(SUITE_TESTS)
    assert not set(DESELECTED) & set(SUITE_TESTS)
    # Every deselected test still exists in the installed dask (the list stays honest).
    assert set(DESELECTED) <= set(vars(dask_suite))


def test_suite_routes_through_engine(engine_calls):
    """A suite test really reaches :func:`rechunk_p2p.rechunk` and builds a P2P shuffle."""
    dask_suite.test_rechunk_2d()
    assert len(engine_calls) == 1
    x = da.ones((10, 30), chunks=((1, 2, 3, 4), (5,) * 6))
    y = dask_suite.rechunk(x, ((5, 5), (15, 15)))
    assert len(engine_calls) == 2
    assert y.name.startswith("rechunk-p2p-")
    assert any(str(k).startswith(BARRIER_PREFIX) for k in y.__dask_graph__())


# --- threshold and block_size_limit --------------------------------------------------------

ARRAYS = {
    "2d-f8": lambda: da.ones((100, 80), chunks=(10, 80)),
    "3d-i2": lambda: da.ones((37, 41, 5), chunks=(7, 41, 1), dtype="i2"),
    "1d-u1": lambda: da.ones(1000, chunks=13, dtype="u1"),
}


def _specs(ndim):
    """Chunk specifications of every kind dask accepts, for an array of ``ndim`` axes."""
    last = ndim - 1
    return [
        "auto",
        -1,
        7,
        "2KiB",
        {0: "auto"},
        {0: -1, last: "auto"},
        {-1: 3},
        tuple("auto" if i % 2 else None for i in range(ndim)),
        tuple([-1] + ["auto"] * last),
    ]


@pytest.mark.parametrize("array", ARRAYS)
def test_threshold_and_block_size_limit_like_dask(array, engine_calls):
    """Every spec x block_size_limit x threshold x array.chunk-size gives dask's chunks."""
    x = ARRAYS[array]()
    limits = [None, 1000, 4096, 1e5, 10**7]
    thresholds = [None, 1, 4, 100]
    rechunked = 0
    for spec, limit, threshold, config_size in itertools.product(
        _specs(x.ndim), limits, thresholds, [None, "8KiB"]
    ):
        settings = {"array.chunk-size": config_size} if config_size else {}
        with dask.config.set(settings):
            before = len(engine_calls)
            kind, chunks = _assert_same_outcome(
                x, spec, threshold=threshold, block_size_limit=limit
            )
            assert len(engine_calls) == before + 1
            rechunked += kind == "ok" and chunks != x.chunks
    assert rechunked > 100  # the grid is not all identities


@pytest.mark.parametrize("array", ARRAYS)
def test_grid_results_computed(array, engine_calls):
    """A few of those rechunks computed on the cluster: values and dtype as dask's."""
    x = ARRAYS[array]()[:40]  # fewer, smaller shuffles than the whole array
    x = x + da.arange(x.shape[-1], chunks=x.chunks[-1]).astype(x.dtype)
    for spec, limit in [(7, None), ({-1: 3}, None), ("auto", 4096), ("2KiB", None)]:
        y = x.rechunk(spec, block_size_limit=limit)
        expected = _tasks(x, spec, block_size_limit=limit)
        assert y.name.startswith("rechunk-p2p-")
        assert y.chunks == expected.chunks
        result = y.compute()  # on the cluster (assert_eq would use the sync scheduler)
        assert result.dtype == expected.dtype
        np.testing.assert_array_equal(result, expected.compute())


# --- "auto" with various dtypes -----------------------------------------------------------

DTYPES = [
    "?",
    "i1",
    "u2",
    "i4",
    "f4",
    "f8",
    "c16",
    "M8[ns]",
    "m8[s]",
    "U7",
    "S3",
    "O",
    [("a", "i4"), ("b", "f8")],
]


def _dtype_id(dtype) -> str:
    return "structured" if isinstance(dtype, list) else dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_auto_chunks_per_dtype_like_dask(dtype):
    """``"auto"`` sizes chunks by itemsize exactly as dask does (object dtype: same error)."""
    x = da.zeros((300, 200, 4), chunks=(1, 200, 4), dtype=dtype)
    kinds = set()
    for spec, limit in itertools.product(
        ["auto", {0: "auto"}, (None, "auto", -1), {1: "auto", 2: 2}], [None, 2**12, 2**16]
    ):
        kinds.add(_assert_same_outcome(x, spec, block_size_limit=limit)[0])
    assert kinds == ({"error"} if np.dtype(dtype).kind == "O" else {"ok"})


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_values_and_dtype_kept(dtype):
    """A rechunk that needs a shuffle returns the same values and dtype for every dtype."""
    ints = np.arange(6 * 40).reshape(6, 40)
    if isinstance(dtype, list):
        a = np.zeros(ints.shape, dtype=dtype)
        a["a"], a["b"] = ints, ints / 2
    else:
        a = ints.astype(dtype)
    x = da.from_array(a, chunks=(1, 40))
    y = x.rechunk((6, 7))
    assert any(str(k).startswith(BARRIER_PREFIX) for k in y.__dask_graph__())
    assert y.dtype == a.dtype
    result = y.compute()
    assert result.dtype == a.dtype
    np.testing.assert_array_equal(result, a)


# --- balance=True -------------------------------------------------------------------------


@pytest.mark.parametrize("length", [7, 13, 100, 210, 997, 1021])
def test_balance_like_dask(length):
    """balance=True gives dask's chunks and warnings for every target size."""
    x = da.ones((length, 3), chunks=(max(length // 3, 1), 3))
    for size in sorted({1, 2, 3, 4, 11, length // 7 or 1, length // 2 or 1, length}):
        _assert_same_outcome(x, (size, -1), balance=True)
        _assert_same_outcome(x, {0: size}, balance=True, block_size_limit=800)
    _assert_same_outcome(x, ("auto", -1), balance=True, block_size_limit=800)


def test_balance_computed():
    """A balanced rechunk that needs a shuffle computes the right values."""
    a = np.arange(220 * 6).reshape(220, 6)
    x = da.from_array(a, chunks=(220, 1))
    y = x.rechunk((100, 6), balance=True)
    assert y.chunks == ((110, 110), (6,))
    np.testing.assert_array_equal(y.compute(), a)


# --- unknown chunk sizes (no dask.dataframe needed) ----------------------------------------


def _unknown_rows():
    x = da.arange(100, chunks=5).reshape(10, 10).rechunk((5, 5), method="tasks")
    y = x[da.arange(10, chunks=5) >= 0]
    assert len(y.chunks[0]) == 2
    assert all(math.isnan(c) for c in y.chunks[0])
    return x, y


def _same(a, b) -> bool:
    return rechunk_p2p.arrays._same_chunks(a, b)


def test_unknown_chunk_sizes(engine_calls):
    """Identity, errors and results as in dask: a known axis of an array with unknown chunk
    sizes along another is rechunked by the engine (the unknown axis passes through)."""
    x, y = _unknown_rows()
    for same in [y.chunks, (None, 5), {1: 5}, {}, ((np.nan, np.nan), None)]:
        assert y.rechunk(same) is y
    for bad in [(None, (5, 5, 5)), ((5, 5), (5, 5)), ((np.nan,) * 3, (5, 5)), "auto"]:
        assert _assert_same_outcome(y, bad)[0] == "error"
    with pytest.raises(ValueError, match="Chunks must be unchanging"):
        y.rechunk(((5, 5), (5, 5)))
    expected = _tasks(y, (None, 10))
    for target, shuffled in [((None, 10), False), ({1: 1}, False), ((None, (3, 7)), True)]:
        calls = len(engine_calls)
        z = y.rechunk(target)
        assert len(engine_calls) == calls + 1
        own = z.dask.layers[z.name]
        assert shuffled == any(str(k).startswith(BARRIER_PREFIX) for k in own)
        assert _same(z.chunks, _tasks(y, target).chunks)
        np.testing.assert_array_equal(z.compute(), x.compute())
    assert "unknown" in repr(rechunk_p2p.plan(y, (None, 10)))
    assert _same(y.rechunk((None, 10)).chunks, expected.chunks)
    known = y.compute_chunk_sizes()
    z = known.rechunk((2, 10))
    assert z.chunks == ((2,) * 5, (10,))
    np.testing.assert_array_equal(z.compute(), x.compute())
    assert len(engine_calls) > 10


# --- what the engine adds or refuses ------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_computed_without_distributed_workers(scheduler):
    """A P2P graph computed by a local scheduler (as dask's assert_eq does) still works."""
    a = np.arange(24 * 30).reshape(24, 30).astype("f4")
    x = da.from_array(a, chunks=(5, 30))
    y = x.rechunk((24, 4))
    assert any(str(k).startswith(BARRIER_PREFIX) for k in y.__dask_graph__())
    result = y.compute(scheduler=scheduler)
    assert result.dtype == a.dtype
    np.testing.assert_array_equal(result, a)
    blocks = dask.compute(*y.to_delayed().ravel(), scheduler=scheduler)
    assert [b.shape for b in blocks] == [(24, 4)] * 7 + [(24, 2)]


def test_masked_chunks_refused():
    """Masked chunks would lose their mask in the shuffle: refused, pointing to 'tasks'."""
    a = np.ma.masked_greater(np.arange(60).reshape(6, 10), 40)
    x = da.from_array(a, chunks=(1, 10), asarray=False)
    assert x.rechunk((1, 10)) is x
    with pytest.raises(TypeError, match="method='tasks'"):
        x.rechunk((6, 3))
    y = x.rechunk((6, 3), method="tasks")
    assert np.ma.getmaskarray(y.compute()).sum() == 19


def test_names_deterministic_like_dask():
    """Same input and chunks, same output name; different chunks, different names."""
    x = da.ones((40, 40), chunks=(4, 40))
    assert x.rechunk((40, 4)).name == x.rechunk((40, 4)).name
    assert x.rechunk((40, 4)).name != x.rechunk((40, 5)).name
    assert x.rechunk({0: 4}) is x
