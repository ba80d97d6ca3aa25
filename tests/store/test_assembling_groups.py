"""The memory store writing a message's batches of several inputs for the same outputs
together: placement, duplicates, refused pieces and failed copies, against writing the
same batches one by one."""

from __future__ import annotations

import numpy as np
import pytest

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.store.ledger import PieceLedger
from rechunk_p2p.transport.wire import Packed, pack_blocks

from .test_assembling_store import _expected, _partial, _pieces, _store


def _messages(partial, data, per_destination: int, named: str, seed: int = 0) -> list:
    """Per group of ``per_destination`` outputs, one message: a batch from every input
    (shuffled), its outputs ``named`` as a range, in order, or permuted."""
    rng = np.random.default_rng(seed)
    by_input: dict[int, dict[int, np.ndarray]] = {}
    for output, input_, array in _pieces(partial, data):
        by_input.setdefault(input_, {})[output] = array
    messages = []
    for first in range(0, partial.n_outputs, per_destination):
        outs = np.arange(first, min(first + per_destination, partial.n_outputs))
        if named == "permuted":
            outs = rng.permutation(outs)
        message = []
        for input_ in rng.permutation(sorted(by_input)).tolist():
            pieces = by_input[input_]
            chosen = [o for o in outs.tolist() if o in pieces]
            if not chosen:
                continue
            shapes = {pieces[o].shape for o in chosen}
            for shape in sorted(shapes):  # (irregular edges: one batch per piece shape)
                these = [o for o in chosen if pieces[o].shape == shape]
                blocks = np.stack([pieces[o] for o in these])
                packed = pack_blocks(np.array(these), input_, blocks, data.dtype)
                if named == "range" and not isinstance(packed.outputs, range):
                    continue  # (only the batches a range names)
                message.append(packed)
        messages.append(message)
    return messages


@pytest.mark.parametrize(
    ("shape", "old", "new", "dtype", "per_destination"),
    [
        ((16, 32, 32), (1, 32, 32), (16, 8, 8), "f4", 4),  # maps to time series
        ((30, 30), (7, 30), (30, 4), "f8", 3),  # irregular edges: two piece shapes
        ((12, 10, 6), (5, 3, 6), (4, 10, 2), "i2", 5),  # strided places
        ((64, 512), (1, 512), (64, 4), "f8", 40),  # thin rows: 40 pieces a batch
    ],
)
@pytest.mark.parametrize("named", ["in order", "permuted"])
def test_a_message_of_many_inputs_fills_outputs_as_single_batches_do(
    shape, old, new, dtype, per_destination, named
) -> None:
    partial = _partial(shape, old, new)
    data = np.random.default_rng(2).integers(0, 1000, shape).astype(dtype)
    messages = _messages(partial, data, per_destination, named)
    assert max(len(m) for m in messages) > 2  # (what is tested: groups of batches)
    together, alone = _store(partial, dtype), _store(partial, dtype)
    for message in messages:
        expected = sum(p.nbytes for p in message)
        assert together.write_packed_blocking(message) == expected
        assert sum(alone.write_packed_blocking([p]) for p in message) == expected
    for flat in range(partial.n_outputs):
        out, missing = together.take_output_blocking(flat)
        assert missing == []
        np.testing.assert_array_equal(out, _expected(partial, data, flat))
        np.testing.assert_array_equal(out, alone.take_output_blocking(flat)[0])
    stats = together.statistics()
    assert stats.pieces == alone.statistics().pieces == len(_pieces(partial, data))
    assert stats.bytes_written == stats.bytes_read == data.nbytes and stats.duplicates == 0
    together.close_blocking()
    alone.close_blocking()


def test_inputs_delivered_again_in_a_message_are_dropped_as_duplicates() -> None:
    partial = _partial((8, 64), (1, 64), (8, 16))  # 4 outputs of 8 x 16
    data = np.arange(8 * 64, dtype="f8").reshape(8, 64)
    outs = np.arange(4)

    def batch(input_: int) -> Packed:
        return pack_blocks(outs, input_, data[input_].reshape(4, 1, 16), data.dtype)

    store = _store(partial)
    each = batch(0).nbytes
    assert store.write_packed_blocking([batch(i) for i in (0, 1, 2)]) == 3 * each
    # input 2 again beside new ones, and input 5 twice in one message
    assert store.write_packed_blocking([batch(i) for i in (2, 3, 4)]) == 2 * each
    assert store.write_packed_blocking([batch(i) for i in (5, 5, 6, 7)]) == 3 * each
    stats = store.statistics()
    assert stats.duplicates == 8 and stats.pieces == 32
    for output in range(4):
        out, missing = store.take_output_blocking(output)
        assert missing == [] and np.array_equal(out, data[:, 16 * output : 16 * output + 16])
    store.close_blocking()


def test_a_wrong_batch_refuses_its_group_before_anything_is_stored(monkeypatch) -> None:
    import rechunk_p2p.store.assembling as assembling

    partial = _partial((30, 30), (7, 30), (30, 4))  # input 4 has rows 28-29 only
    data = np.arange(900, dtype="f8").reshape(30, 30)
    outs = np.arange(7)  # the outputs of 4 columns

    def batch(input_: int, rows: int = 7) -> Packed:
        block = np.zeros((7, rows, 4))
        found = np.stack([data[7 * input_ : 7 * input_ + rows, 4 * o : 4 * o + 4] for o in outs])
        block[:, : found.shape[1]] = found
        return pack_blocks(outs, input_, block, data.dtype)

    store = _store(partial)
    with pytest.raises(RechunkRunError, match=r"shape \(7, 4\) for output 0 from input 4"):
        store.write_packed_blocking([batch(3), batch(4)])  # input 4's pieces have 2 rows
    assert store.statistics().pieces == 0
    # a copy that fails gives its pairs back: the same batches may come again
    real = assembling.copy_inputs_blocking

    def failing(*args, **kwargs):
        raise OSError("copy failed")

    monkeypatch.setattr(assembling, "copy_inputs_blocking", failing)
    with pytest.raises(OSError, match="copy failed"):
        store.write_packed_blocking([batch(0), batch(1)])
    monkeypatch.setattr(assembling, "copy_inputs_blocking", real)
    accepted = store.write_packed_blocking([batch(i) for i in range(4)] + [batch(4, 2)])
    assert accepted == 8 * (4 * 7 * 7 * 4 + 7 * 2 * 4)  # 4 inputs of 7 rows, one of 2
    out, missing = store.take_output_blocking(2)
    assert missing == [] and np.array_equal(out, data[:, 8:12])
    assert store.statistics().duplicates == 0
    store.close_blocking()


def test_the_ledger_admits_several_inputs_only_when_every_pair_is_new() -> None:
    ledger = PieceLedger()
    outs = np.arange(4, 8)
    assert ledger.admit_inputs([0, 1], outs, ascending=True)
    assert not ledger.admit_inputs([2, 1], np.array([7, 9]), ascending=True)  # (1, 7) held
    assert not ledger.holds(9, 2)  # nothing taken from a refused group
    assert ledger.admit_inputs([2, 1], np.array([8, 9]), ascending=True)  # beside runs held
    assert ledger.holds(9, 1) and ledger.holds(4, 1) and not ledger.holds(3, 1)
    assert not ledger.admit_inputs([3, 3], outs, ascending=True)  # an input twice
    assert not ledger.admit_inputs([3], outs[::-1], ascending=False)
    assert not ledger.holds(4, 3)
    assert ledger.duplicates == 0  # (counted by the caller's admission, input by input)
