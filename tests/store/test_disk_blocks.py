"""The disk store keeps regular batches whole: one index row per output and flush, not one a
piece, and reads give back exactly what was written (values, duplicates, shapes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rechunk_p2p.store import DiskPieceStore
from rechunk_p2p.store.disk_blocks import (
    Block,
    expand_rows,
    group_of,
    group_rows,
    grouped,
    slabs,
)
from rechunk_p2p.transport.wire import pack_blocks

from .test_stacked_read import partial_of, write_all


def index_rows(store: DiskPieceStore) -> int:
    return store._index.rows()


def test_thin_rows_into_strips_keep_one_index_row_per_output_and_flush(tmp_path):
    """256 one-row inputs -> 16 strips of 4 columns: 4,096 pieces of 32 bytes, gathered in
    one buffer: 16 index rows, and every strip read back equal."""
    partial = partial_of(((1,) * 256, (64,)), ((256,), (4,) * 16))
    data = np.random.default_rng(0).random((256, 64))
    store = DiskPieceStore(data.dtype, str(tmp_path), "t", buffer_bytes=1 << 20)
    write_all(store, partial, data, packed=True)
    out = np.empty((256, 4))
    assert store.read_stacked_blocking(0, out, partial.stacked_inputs(0)) == list(range(256))
    np.testing.assert_array_equal(out, data[:, :4])
    assert index_rows(store) == 15  # the other outputs: one row each (a piece is 4,096)
    assert store.statistics().pieces == 4096
    for flat in range(1, 16):
        out = np.empty((256, 4))
        placement = dict(partial.pieces_of_output(flat))
        assert sorted(store.read_into_blocking(flat, out, placement)) == list(range(256))
        np.testing.assert_array_equal(out, data[:, flat * 4 : flat * 4 + 4])
    assert store.statistics().bytes_buffered == 0
    store.close_blocking()


def test_a_batch_sent_again_or_partly_again_is_stored_once(tmp_path):
    store = DiskPieceStore(np.dtype("i4"), str(tmp_path), "d", buffer_bytes=1 << 20)
    rows = np.arange(24, dtype="i4").reshape(4, 6)  # input 0; outputs 0-2 take 2 columns

    def batch(input_: int, outputs: list[int], values: np.ndarray):
        parts = np.stack([values[:, 2 * o : 2 * o + 2] for o in outputs])
        return pack_blocks(np.array(outputs), input_, parts, np.dtype("i4"))

    store.write_packed_blocking([batch(0, [0, 1], rows)])
    store.write_packed_blocking([batch(0, [0, 1, 2], rows)])  # 0 and 1 again
    store.write_packed_blocking([batch(1, [0, 1, 2], rows + 100)])
    assert store.statistics().duplicates == 2
    assert store.statistics().pieces == 6
    for output in range(3):
        got = dict(store.read_blocking(output))
        assert sorted(got) == [0, 1]
        np.testing.assert_array_equal(got[0], rows[:, 2 * output : 2 * output + 2])
        np.testing.assert_array_equal(got[1], rows[:, 2 * output : 2 * output + 2] + 100)
    store.close_blocking()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 3), st.lists(st.integers(0, 7), min_size=1)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 64),
)
def test_groups_expand_back_to_the_pieces_written(batches, slab_bytes):
    """Blocks of several inputs, sizes and output sets, laid out output-major in slabs of
    any size: expanding the rows finds every piece's bytes where they were written."""
    blocks, used = [], set()
    for input_, size, outputs in batches:
        if input_ in used:
            continue  # one block an input (the store drops repeats before)
        used.add(input_)
        outs = np.array(sorted(set(outputs)), dtype=np.int64)
        payload = np.arange(len(outs) * size, dtype=np.uint8) + input_ * 50
        blocks.append(Block(outs, input_, size, size, payload))
    file = bytearray()
    rows, groups = [], []
    for outputs, members in grouped(blocks):
        group = group_of(members)
        groups.append(group)
        for outs, data in slabs(outputs, members, slab_bytes):
            r = group_rows(outs, len(groups) - 1, group.row_bytes)
            r["offset"] = len(file) + np.arange(len(outs)) * group.row_bytes
            file.extend(data.tobytes())
            rows.append(r)
    expanded = expand_rows(np.concatenate(rows), groups)
    assert (expanded["group"] == -1).all()
    want = {
        (int(o), b.input): b.payload[k * b.size : (k + 1) * b.size].tobytes()
        for b in blocks
        for k, o in enumerate(b.outputs.tolist())
    }
    got = {
        (int(r["output"]), int(r["input"])): bytes(file[r["offset"] : r["offset"] + r["nbytes"]])
        for r in expanded
    }
    assert got == want
    assert {int(r["shape"]) for r in expanded} <= {b.shape_id for b in blocks}


@pytest.mark.parametrize("direct_io", [False, True])
def test_blocks_and_single_pieces_mix_in_one_flush(tmp_path, direct_io):
    store = DiskPieceStore(np.dtype("f8"), str(tmp_path), "m", 1 << 20, direct_io=direct_io)
    a = np.arange(12.0).reshape(2, 6)
    strips = np.ascontiguousarray(a.reshape(2, 3, 2).transpose(1, 0, 2))
    store.write_packed_blocking([pack_blocks(np.array([0, 1, 2]), 0, strips, np.dtype("f8"))])
    store.write_blocking([(1, 1, np.full((1, 2), -1.0))])
    got = dict(store.read_blocking(1))
    np.testing.assert_array_equal(got[0], a[:, 2:4])
    np.testing.assert_array_equal(got[1], [[-1.0, -1.0]])
    store.close_blocking()
