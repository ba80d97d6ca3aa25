"""The memory store that places shards into their output chunks as they arrive."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rechunk_p2p.buffers import AssemblingShardStore, ShardStore, make_store
from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.planning import Partial

from .test_store_roundtrip import sample


def partial_of(old: tuple[tuple[int, ...], ...], new: tuple[tuple[int, ...], ...]) -> Partial:
    zeros = (0,) * len(old)
    return Partial(zeros, zeros, zeros, old, new)


def shards_of(partial: Partial, data: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """Every shard of ``data`` (the whole partial's array), cut as the engine cuts it."""
    starts = [np.cumsum((0, *c)) for c in partial.old_chunks]
    out = []
    for flat, index in enumerate(itertools.product(*(range(n) for n in partial.old_grid))):
        box = tuple(slice(s[i], s[i + 1]) for s, i in zip(starts, index))
        chunk = data[box]
        for output, where in partial.shards_of_input(flat):
            out.append((output, flat, chunk[where]))
    return out


def output_of(partial: Partial, data: np.ndarray, flat: int) -> np.ndarray:
    starts = [np.cumsum((0, *c)) for c in partial.new_chunks]
    index = np.unravel_index(flat, partial.new_grid)
    return data[tuple(slice(s[i], s[i + 1]) for s, i in zip(starts, index))]


def chunks_summing_to(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Random chunk lengths (zero-length chunks included) summing to ``n``."""
    cuts = st.lists(st.integers(0, n), max_size=4)
    return cuts.map(lambda c: tuple(np.diff([0, *sorted(c), n]).tolist()))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Partial, np.ndarray]:
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    old = tuple(draw(chunks_summing_to(n)) for n in shape)
    new = tuple(draw(chunks_summing_to(n)) for n in shape)
    dtype = draw(st.sampled_from(["f8", "i2", "U3", "O", ">c8"]))
    return partial_of(old, new), sample(dtype, tuple(shape), seed=draw(st.integers(0, 99)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.randoms(use_true_random=False))
def test_outputs_are_built_from_shards_in_any_order_from_many_threads(layout, rnd):
    partial, data = layout
    shards = shards_of(partial, data)
    repeated = shards + rnd.sample(shards, len(shards) // 3)  # retried deliveries
    rnd.shuffle(repeated)
    store = make_store("memory", dtype=data.dtype, directory=None, name="a", layout=partial)
    assert isinstance(store, AssemblingShardStore) and isinstance(store, ShardStore)
    batches = [repeated[i::3] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(store.write_blocking, batches))
    for flat in range(partial.n_outputs):
        out, inputs = store.take_blocking(flat)
        assert len(inputs) == partial.n_shards_of_output(flat)
        if inputs:
            np.testing.assert_array_equal(out, output_of(partial, data, flat))
            assert out.flags.c_contiguous and out.flags.writeable
    stats = store.statistics()
    assert stats.duplicates == len(repeated) - len(shards)
    assert stats.bytes_read == stats.bytes_written == sum(a.nbytes for _, _, a in shards)
    assert stats.bytes_buffered == 0 and stats.outputs == 0
    store.close_blocking()


def test_read_blocking_gives_each_inputs_piece_in_input_order():
    partial = partial_of(((2, 2, 2),), ((3, 3),))
    data = np.arange(6.0)
    store = AssemblingShardStore(data.dtype, "r", partial)
    store.write_blocking(reversed(shards_of(partial, data)))
    assert [(i, a.tolist()) for i, a in store.read_blocking(1)] == [(1, [3.0]), (2, [4.0, 5.0])]
    assert store.read_blocking(1) == []  # taken
    out = np.zeros(3)
    assert sorted(store.read_into_blocking(0, out, {0: (slice(0, 2),), 1: (slice(2, 3),)})) == [
        0,
        1,
    ]
    assert out.tolist() == [0.0, 1.0, 2.0]


def test_a_shard_that_is_no_piece_of_its_output_is_refused_before_anything_is_placed():
    partial = partial_of(((2, 2),), ((1, 3),))
    store = AssemblingShardStore(np.dtype("f8"), "bad", partial)
    good = (1, 1, np.ones(2))
    with pytest.raises(RechunkRunError, match=r"input 1 for output 0 .* no piece"):
        store.write_blocking([good, (0, 1, np.ones(2))])  # input 1 holds nothing of output 0
    with pytest.raises(RechunkRunError, match=r"shape \(3,\); that output holds \(2,\)"):
        store.write_blocking([(1, 1, np.ones(3))])
    assert store.statistics().shards == 0
    assert store.take_blocking(1) == (None, [])


def test_a_closed_store_refuses_writes_and_reads():
    partial = partial_of(((2, 2),), ((1, 3),))
    store = AssemblingShardStore(np.dtype("f8"), "closed", partial)
    store.write_blocking([(1, 1, np.ones(2))])
    store.close_blocking()
    store.close_blocking()  # idempotent
    assert store.statistics().bytes_buffered == 0
    with pytest.raises(RechunkRunError, match="closed"):
        store.write_blocking([(1, 1, np.ones(2))])
    with pytest.raises(RechunkRunError, match="closed"):
        store.take_blocking(1)


def test_without_a_layout_memory_storage_keeps_the_shards():
    store = make_store("memory", dtype=np.dtype("f8"), directory=None, name="k")
    assert not isinstance(store, AssemblingShardStore)
    store.close_blocking()


def test_shards_are_copied_so_the_received_message_can_be_freed():
    partial = partial_of(((2, 2),), ((1, 3),))
    store = AssemblingShardStore(np.dtype("f8"), "copy", partial)
    payload = np.arange(4.0)
    store.write_blocking([(1, 1, payload[2:]), (1, 0, payload[1:2])])
    payload[:] = -1  # the message's buffer is reused
    out, inputs = store.take_blocking(1)
    assert out.tolist() == [1.0, 2.0, 3.0] and sorted(inputs) == [0, 1]
