"""The RechunkPlan dataclass: its counts against brute force, its repr, its value semantics."""

from __future__ import annotations

import dataclasses
import math
import pickle
import re

import numpy as np
import pytest
from dask.utils import format_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from rechunk_p2p.planning import RechunkPlan, make_partials

from .strategies import brute_piece_pairs, chunk_slices, rechunks

SETTINGS = settings(max_examples=200, deadline=None)
dtypes = st.sampled_from(["i1", "u2", "f4", "f8", "c16", "bool", "O", "S3", "M8[ns]"]).map(np.dtype)
plans = st.builds(
    lambda case, dtype, n_workers: RechunkPlan(case[0], dtype, case[1], case[2], n_workers),
    rechunks(),
    dtypes,
    st.integers(1, 16),
)


def chunk_shapes(chunks):
    return [tuple(s.stop - s.start for s in slices) for slices in chunk_slices(chunks).values()]


@SETTINGS
@given(plans)
def test_counts_agree_with_brute_force(plan):
    itemsize = np.empty(0, dtype=plan.dtype).itemsize
    partials = make_partials(plan.old_chunks, plan.new_chunks)
    assert plan.partials == partials
    assert plan.n_partials == len(partials)
    assert plan.n_input_chunks == len(chunk_slices(plan.old_chunks))
    assert plan.n_output_chunks == len(chunk_slices(plan.new_chunks))
    assert plan.n_pieces == len(brute_piece_pairs(plan.shape, plan.old_chunks, plan.new_chunks))

    shuffled = [p for p in partials if p.needs_shuffle]
    assert plan.n_shuffles == len(shuffled)
    # Per shuffled partial: a transfer per input, a barrier, an unpack per output; elsewhere
    # one task per output chunk.
    assert plan.n_tasks == sum(
        p.n_inputs + 1 + p.n_outputs if p.needs_shuffle else p.n_outputs for p in partials
    )

    assert plan.itemsize == itemsize
    assert plan.nbytes == np.empty(plan.shape, dtype=plan.dtype).nbytes
    largest_in = max((math.prod(s) for s in chunk_shapes(plan.old_chunks)), default=0)
    largest_out = max((math.prod(s) for s in chunk_shapes(plan.new_chunks)), default=0)
    assert plan.largest_input_chunk_bytes == largest_in * itemsize
    assert plan.largest_output_chunk_bytes == largest_out * itemsize

    shuffled_bytes = sum(p.size for p in shuffled) * itemsize
    assert plan.bytes_shuffled == shuffled_bytes
    assert 0 <= plan.bytes_moved <= shuffled_bytes
    assert plan.per_worker_buffer_bytes * plan.n_workers >= shuffled_bytes
    assert (plan.per_worker_buffer_bytes - 1) * plan.n_workers < max(shuffled_bytes, 1)
    if plan.n_workers == 1:
        assert plan.bytes_moved == 0


def repr_line(text: str, label: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith(label)]
    return line


def numbers(line: str) -> set[int]:
    return {int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", line)}


@SETTINGS
@given(plans)
def test_repr_mentions_the_key_figures(plan):
    text = repr(plan)
    first = text.splitlines()[0]
    assert str(plan.shape) in first and str(plan.dtype) in first
    assert format_bytes(plan.nbytes) in first
    count = repr_line(text, "chunk count")
    assert f"{plan.n_input_chunks} -> {plan.n_output_chunks}" in count
    assert plan.n_pieces in numbers(count)
    assert {plan.n_partials, plan.n_shuffles} <= numbers(repr_line(text, "partials"))
    assert plan.n_tasks in numbers(repr_line(text, "tasks"))
    assert format_bytes(plan.bytes_shuffled) in repr_line(text, "shuffled")
    largest = repr_line(text, "largest")
    assert format_bytes(plan.largest_input_chunk_bytes) in largest
    assert format_bytes(plan.largest_output_chunk_bytes) in largest
    html = plan._repr_html_()
    assert html.startswith('<div class="rechunk-p2p">') and "<table" in html
    assert f"<td>{plan.n_input_chunks} -&gt; {plan.n_output_chunks} (" in html
    assert html.count("<tr>") == len(plan.rows()) == len(repr(plan).splitlines()) - 1


def test_repr_example():
    plan = RechunkPlan((100, 60), np.dtype("f8"), ((10,) * 10, (60,)), ((100,), (6,) * 10), 4)
    text = repr(plan)
    assert "(100, 60) float64" in text
    assert "10 -> 10 (100 pieces)" in text
    assert "partials     1 (1 shuffled)" in text
    assert "tasks        21" in text  # 10 transfers, 1 barrier, 10 unpacks


@SETTINGS
@given(plans)
def test_plan_is_immutable_and_a_value(plan):
    same = RechunkPlan(
        tuple(plan.shape),
        np.dtype(plan.dtype.str if plan.dtype.kind != "O" else object),
        tuple(map(tuple, plan.old_chunks)),
        tuple(map(tuple, plan.new_chunks)),
        plan.n_workers,
    )
    _ = plan.n_tasks, plan.n_pieces, plan.partials  # cached figures do not change the value
    assert plan == same and hash(plan) == hash(same)
    other = dataclasses.replace(plan, n_workers=plan.n_workers + 1)
    assert other != plan
    clone = pickle.loads(pickle.dumps(plan))
    assert clone == plan and hash(clone) == hash(plan) and clone.n_tasks == plan.n_tasks
    for field in dataclasses.fields(plan):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, field.name, getattr(plan, field.name))
    assert len({plan, same, clone}) == 1


def test_zero_dimensional_plan():
    plan = RechunkPlan((), np.dtype("i4"), (), ())
    assert (plan.n_partials, plan.n_input_chunks, plan.n_output_chunks) == (1, 1, 1)
    assert (plan.n_pieces, plan.n_shuffles, plan.n_tasks) == (1, 0, 1)
    assert plan.nbytes == plan.largest_input_chunk_bytes == 4
