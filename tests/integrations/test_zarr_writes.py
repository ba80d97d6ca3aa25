"""The write task of a zarr target: what it writes, what it leaves unwritten (real stores)."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.core.buffer.core import NDBuffer

from rechunk_p2p.integrations.zarr_writes import _write_block


@pytest.fixture
def compared(monkeypatch):
    """A list that grows by one each time zarr compares a chunk with the fill value."""
    calls: list[int] = []
    original = NDBuffer.all_equal

    def counting(self, other, equal_nan=True):
        calls.append(1)
        return original(self, other, equal_nan=equal_nan)

    monkeypatch.setattr(NDBuffer, "all_equal", counting)
    return calls


@pytest.mark.parametrize("fill", [0.0, np.nan])
def test_chunks_of_fill_value_stay_unwritten_and_others_skip_the_comparison(
    tmp_path, compared, fill
):
    """A chunk whose first element differs from the fill value is written without zarr's
    element-by-element comparison; chunks that start with the fill value are compared, and
    those that are all fill value are not written, as zarr does by default."""
    target = zarr.create_array(
        tmp_path / "t.zarr", shape=(4, 6), chunks=(2, 3), dtype="f8", fill_value=fill
    )
    blocks = {
        (0, 0): np.full((2, 3), fill),  # all fill value: left unwritten
        (0, 1): np.array([[fill, 5.0, fill], [fill] * 3]),  # starts with it: compared
        (1, 0): np.arange(1.0, 7.0).reshape(2, 3),  # cannot be all fill value
        (1, 1): np.array([[-0.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),  # -0.0: zarr tells 0.0 apart
    }
    checked = {}
    for (i, j), block in blocks.items():
        before = len(compared)
        where = (slice(2 * i, 2 * i + 2), slice(3 * j, 3 * j + 3))
        _write_block(block, target, where, None, (i, j))
        checked[i, j] = len(compared) > before
    assert checked == {(0, 0): True, (0, 1): True, (1, 0): False, (1, 1): fill == 0}
    written = {k for k in (tmp_path / "t.zarr" / "c").rglob("*") if k.is_file()}
    names = {tuple(int(p) for p in k.relative_to(tmp_path / "t.zarr" / "c").parts) for k in written}
    assert names == {(0, 1), (1, 0), (1, 1)}
    expected = np.block([[blocks[0, 0], blocks[0, 1]], [blocks[1, 0], blocks[1, 1]]])
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "t.zarr")[...], expected)


def test_shards_are_left_to_zarr(tmp_path, compared):
    """A shard's inner chunks are compared one by one, as zarr does (an inner chunk of fill
    value stays out of the shard)."""
    target = zarr.create_array(
        tmp_path / "s.zarr", shape=(4, 6), shards=(4, 6), chunks=(2, 3), dtype="f8", fill_value=0
    )
    block = np.zeros((4, 6))
    block[0, 0] = 1.0
    _write_block(block, target, (slice(0, 4), slice(0, 6)), None, (0, 0))
    assert len(compared) == 4  # every inner chunk
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "s.zarr")[...], block)
