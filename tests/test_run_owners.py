"""Which workers of a run assemble outputs: the ones whose loss restarts it."""

from __future__ import annotations

import numpy as np

from rechunk_p2p.planning import make_partials
from rechunk_p2p.spec import RunId, RunSpec, ShuffleId, ShuffleSpec


def run_spec(n_outputs: int, workers: int, keep: frozenset[int] | None = None) -> RunSpec:
    """A run of 8 row blocks -> ``n_outputs`` column blocks (a divisor of 8)."""
    (partial,) = make_partials(((1,) * 8, (8,)), ((8,), (8 // n_outputs,) * n_outputs))
    spec = ShuffleSpec(
        shuffle_id=ShuffleId("t-0.0"),
        partial=partial,
        dtype=np.dtype("f8"),
        storage="memory",
        output_name="out",
        keep=keep,
    )
    names = tuple(f"w{i}" for i in range(workers))
    return RunSpec(spec=spec, run_id=RunId(1), workers=names, dataplanes=names, shift=0)


def test_owners_are_the_workers_some_output_is_assigned_to():
    for n_outputs, workers in [(8, 3), (2, 3), (1, 4), (8, 8)]:
        rs = run_spec(n_outputs, workers)
        assigned = {rs.worker_for(flat) for flat in rs.spec.outputs}
        assert rs.owners() == frozenset(assigned)
    assert len(run_spec(2, 3).owners()) == 2  # one worker is a bystander


def test_a_culled_run_is_owned_by_the_workers_of_the_kept_outputs():
    rs = run_spec(8, 4, keep=frozenset({0, 7}))
    assert rs.owners() == frozenset(rs.worker_for(flat) for flat in (0, 7))
    assert len(rs.owners()) == 2
