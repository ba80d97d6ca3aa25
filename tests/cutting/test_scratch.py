"""Cut buffers: lent to their holders, used again only after the last one let go."""

from __future__ import annotations

import gc

import numpy as np

from rechunk_p2p.cutting.scratch import CutBuffers


class Batch:
    """Stands for a packed batch viewing a buffer."""


def test_a_buffer_is_used_again_only_after_its_cut_and_every_batch_let_go() -> None:
    cuts = CutBuffers()
    first = cuts.take(100)
    batches = [Batch(), Batch()]
    cuts.hold(first, batches)
    cuts.release(first, first)  # the cut is done; its batches are in flight
    second = cuts.take(100)
    assert second is not first and cuts.made == 2
    cuts.release(first, batches[0])
    cuts.release(first, batches[0])  # the same holder twice: ignored
    assert cuts.free == 0
    cuts.release(first, batches[1])
    assert cuts.free == 1
    assert cuts.take(80) is first  # the smallest free one that fits
    assert cuts.take(200) is not first and cuts.made == 3


def test_a_buffer_whose_batch_was_dropped_is_never_lent_again_and_is_freed() -> None:
    cuts = CutBuffers()
    buffer = cuts.take(64)
    view = buffer[:8]  # the dropped batch's payload still views it
    cuts.hold(buffer, [Batch()])
    cuts.release(buffer, buffer)
    assert cuts.free == 0 and len(cuts._lent) == 1
    del buffer, view
    gc.collect()
    assert cuts._lent == {}  # forgotten with the last array viewing it


def test_unknown_buffers_are_ignored_and_close_lets_every_buffer_go() -> None:
    cuts = CutBuffers(max_free=1)
    cuts.release(np.empty(4, dtype=np.uint8), "anyone")
    cuts.release(None, None)
    a, b = cuts.take(8), cuts.take(16)
    cuts.release(a, a)
    cuts.release(b, b)
    assert cuts.free == 1 and cuts.take(1) is b  # the smallest went first
    c = cuts.take(8)
    cuts.close()
    cuts.release(c, c)  # after close: not kept
    cuts.release(b, b)
    assert cuts.free == 0 and cuts._lent == {}


def test_many_free_buffers_of_many_sizes_are_chosen_by_size() -> None:
    cuts = CutBuffers(max_free=3)
    buffers = [cuts.take(n) for n in (30, 10, 40, 20)]
    for b in buffers:
        cuts.release(b, b)
    assert cuts.free == 3  # the 10-byte one went
    assert cuts.take(25) is buffers[0]  # the smallest that fits: 30
    assert cuts.take(15) is buffers[3]  # 20
    assert cuts.take(15) is buffers[2]  # 40
    assert cuts.free == 0


def test_free_buffers_stay_within_their_bytes() -> None:
    cuts = CutBuffers(max_free=4, max_free_bytes=100)
    buffers = [cuts.take(n) for n in (60, 30, 20, 200)]
    for b in buffers:
        cuts.release(b, b)
    # 200 alone is past the bound; of 60 + 30 + 20, the smallest goes
    assert cuts.free == 2 and cuts.take(50) is buffers[0] and cuts.take(25) is buffers[1]
