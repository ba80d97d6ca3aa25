"""Output placement knows the cluster: each worker assembles outputs in proportion to its
memory limit (a mixed cluster fills each worker alike), at a run's start and when outputs
move (the decisions' table cases are in test_recovery_decisions.py)."""

from __future__ import annotations

import dask.array as da
import numpy as np
from distributed import wait
from distributed.utils_test import gen_cluster

import rechunk_p2p
from tests.conftest import assert_clean

GIB = 2**30
MIXED = [("127.0.0.1", 1, {"memory_limit": 2 * GIB}), ("127.0.0.1", 1, {"memory_limit": 8 * GIB})]
EQUAL = [("127.0.0.1", 1, {"memory_limit": 4 * GIB})] * 2


async def _output_bytes(c, held) -> dict[str, int]:
    """Bytes of the outputs of ``held`` each worker holds."""
    where = await c.who_has(held)
    sizes = await c.nbytes(summary=False)
    out: dict[str, int] = {}
    for key, workers in where.items():
        for w in workers:
            out[w] = out.get(w, 0) + sizes[key]
    return out


async def _rechunk_held(c) -> tuple[dict[str, int], bool]:
    arr = np.arange(100 * 100, dtype="f8").reshape(100, 100)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 100)), (100, 10))
    held = c.persist(y)
    await wait(held)
    placed = await _output_bytes(c, held)  # (before a compute copies them to one worker)
    exact = np.array_equal(await c.compute(held), arr)
    del held
    return placed, exact


async def _placed_in_strips(c, s, a, b, strips: tuple[int, int]) -> None:
    """A rechunk into 10 column strips of 8 kB puts ``strips`` on ``a`` and ``b``; values
    exact, nothing left."""
    await rechunk_p2p.register(c)
    placed, exact = await _rechunk_held(c)
    assert exact
    assert placed == {a.address: strips[0] * 8000, b.address: strips[1] * 8000}, placed
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=MIXED)
async def test_outputs_fill_workers_in_proportion_to_their_memory_limits(c, s, small, large):
    await _placed_in_strips(c, s, small, large, (2, 8))  # 2 GiB and 8 GiB


@gen_cluster(client=True, nthreads=EQUAL)
async def test_workers_with_equal_limits_take_equal_shares(c, s, a, b):
    await _placed_in_strips(c, s, a, b, (5, 5))


def _run_spec(n_outputs: int, workers: str):
    from rechunk_p2p.planning import make_partials
    from rechunk_p2p.spec import RunId, RunSpec, ShuffleId, ShuffleSpec

    (p,) = make_partials(((4,), (n_outputs,)), ((4,), (1,) * n_outputs))
    spec = ShuffleSpec(ShuffleId("s-0"), p, np.dtype("f8"), "memory", "out")
    return RunSpec(spec, RunId(1), tuple(workers), tuple(workers.upper()), shift=0)


def test_outputs_of_a_worker_that_left_move_in_proportion_to_memory_limits():
    from rechunk_p2p.spec import RunId

    run = _run_spec(12, "abc")
    after = run.continued_without("b", RunId(2), weights=(1, 3))  # a: 1 GiB, c: 3 GiB
    assert "".join(after.worker_for(i) for i in range(12)) == "aaaaaccc" + "cccc"
    even = run.continued_without("b", RunId(2))
    assert "".join(even.worker_for(i) for i in range(12)) == "aaaaaacc" + "cccc"


def test_a_joined_worker_with_more_memory_takes_more():
    from rechunk_p2p.spec import RunId

    run = _run_spec(12, "ab")  # 6 outputs each
    # a and b have 1 GiB, the joined c 4 GiB: shares 2, 2 and 8
    after = run.continued_with(("c",), ("C",), RunId(2), weights=(1, 1, 4))
    assert "".join(after.worker_for(i) for i in range(12)) == "aaccccbbcccc"
    even = run.continued_with(("c",), ("C",), RunId(2))
    assert "".join(even.worker_for(i) for i in range(12)) == "aaaaccbbbbcc"
