"""Helpers shared by the engine's cluster tests: reference arrays and one checked rechunk.

Where it runs: the test process (client side of gen_cluster or LocalCluster tests).
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import numpy as np

import rechunk_p2p
from rechunk_p2p.spec import PLUGIN_NAME

PLUGIN = PLUGIN_NAME
ONE = [("127.0.0.1", 1)]
TWO = ONE * 2
THREE = ONE * 3


def reference_chunks(x: da.Array, chunks: Any, **kwargs: Any) -> tuple:
    """The chunks dask's own task-based rechunk produces for the same request."""
    return x.rechunk(chunks, method="tasks", **kwargs).chunks


def check_graph(x: da.Array, y: da.Array, chunks: Any, **kwargs: Any) -> None:
    """``y`` (the engine's result) has dask's chunks, ``x``'s dtype and P2P keys."""
    assert y.chunks == reference_chunks(x, chunks, **kwargs), (chunks, kwargs)
    assert y.dtype == x.dtype
    if y is not x:
        assert y.name.startswith("rechunk-p2p-"), y.name


def check_result(result: np.ndarray, expected: np.ndarray) -> None:
    """Equal values and equal dtype."""
    assert isinstance(result, np.ndarray), type(result)
    assert result.dtype == expected.dtype, (result.dtype, expected.dtype)
    assert result.shape == expected.shape, (result.shape, expected.shape)
    np.testing.assert_array_equal(result, expected)


async def check_rechunk(
    c: Any, s: Any, x: da.Array, expected: np.ndarray, chunks: Any, **kwargs: Any
) -> da.Array:
    """Rechunk ``x`` on a gen_cluster and check chunks, values, dtype and the runs created.

    Every sub-shuffle the plan counts creates exactly one run on the scheduler; partials that
    need no shuffle create none.
    """
    plugin = s.plugins[PLUGIN]
    before = plugin.runs_created
    y = rechunk_p2p.rechunk(x, chunks, **kwargs)
    check_graph(x, y, chunks, **kwargs)
    check_result(await c.compute(y), expected)
    n_shuffles = 0 if y is x else rechunk_p2p.plan(x, chunks, **kwargs).n_shuffles
    assert plugin.runs_created - before == n_shuffles, (chunks, kwargs)
    return y


async def check_many(c: Any, s: Any, cases: list[tuple]) -> list[da.Array]:
    """:func:`check_rechunk` for many ``(x, expected, chunks, kwargs)`` cases in one compute.

    All rechunks run at the same time, in one graph.
    """
    plugin = s.plugins[PLUGIN]
    before = plugin.runs_created
    ys, shuffles = [], {}
    for x, _, chunks, kwargs in cases:
        y = rechunk_p2p.rechunk(x, chunks, **kwargs)
        check_graph(x, y, chunks, **kwargs)
        if y is not x:  # equal requests share their keys, and so their runs
            shuffles[y.name] = rechunk_p2p.plan(x, chunks, **kwargs).n_shuffles
        ys.append(y)
    results = await c.gather(c.compute(ys))
    for result, (_, expected, chunks, kwargs) in zip(results, cases):
        try:
            check_result(result, expected)
        except AssertionError as e:
            raise AssertionError(f"rechunk to {chunks} {kwargs} of {expected.dtype}: {e}") from e
    assert plugin.runs_created - before == sum(shuffles.values())
    return ys


def assert_storage_used(storage: str, *workers: Any) -> None:
    """The runs of these in-process workers buffered pieces where ``storage`` says."""
    from rechunk_p2p.worker.plugin import get_plugin

    totals = [get_plugin(w).totals() for w in workers]
    assert sum(t.runs for t in totals) > 0, "no run took place"
    spilled = sum(t.bytes_spilled for t in totals)
    assert (spilled > 0) == (storage == "disk"), (storage, spilled)


def sample_arrays() -> dict[str, np.ndarray]:
    """One small (6, 8) array per dtype family, with awkward values (NaN, NaT, None)."""
    base = np.arange(48).reshape(6, 8) * 7 % 100
    arrays = {
        dt: base.astype(dt)
        for dt in (
            *("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "?"),
            *("f2", "f4", "f8", "c8", "c16", ">i4", ">f8", ">c8"),
            *("M8[ns]", "M8[D]", "m8[s]", "m8[ns]", "S5", "U7"),
        )
    }
    arrays["f8"][1, 1] = np.nan
    arrays["M8[ns]"][0, 0] = np.datetime64("NaT")
    arrays["m8[s]"][2, 3] = np.timedelta64("NaT")
    arrays["U7"][3, 4] = "ünïcødé"
    arrays["longdouble"] = base.astype(np.longdouble) / 3
    structured = np.zeros((6, 8), dtype=[("a", "i4"), ("b", "f8"), ("c", "S3"), ("d", "2u1")])
    structured["a"], structured["b"], structured["c"] = base, base / 3, base.astype("S3")
    structured["d"] = base[..., None] % 7
    arrays["structured"] = structured
    objects = np.empty((6, 8), dtype=object)
    for i, j in np.ndindex(6, 8):
        objects[i, j] = (i, {"j": [j] * (i % 3)}) if (i + j) % 3 else f"s{i}{j}"
    objects[0, 1] = None
    arrays["object"] = objects
    return arrays
