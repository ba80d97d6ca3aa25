"""The data plane's receive buffers: lent by size, kept within limits, let go when idle.

Where it runs: the test's thread (the pool is loop-confined; nothing here needs a loop).
"""

from __future__ import annotations

import numpy as np

from rechunk_p2p.transport.receive_buffers import ReceiveBuffers


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_buffer_given_back_serves_the_next_payload_that_fits():
    buffers = ReceiveBuffers()
    first = buffers.take(1000)
    assert first.nbytes == 1000 and first.dtype == np.uint8 and buffers.made == 1
    buffers.give_back(first)
    assert buffers.free_bytes == 1000
    second = buffers.take(800)  # fits, wasting less than it holds
    assert second.nbytes == 800 and address(second) == address(first)
    assert (buffers.made, buffers.reused, buffers.free_bytes) == (1, 1, 0)
    buffers.give_back(second)  # a view: its whole buffer comes back
    assert buffers.free_bytes == 1000
    third = buffers.take(400)  # would waste more than it holds: a new one
    assert address(third) != address(first) and buffers.made == 2
    assert buffers.take(2000).nbytes == 2000 and buffers.made == 3  # too small: a new one


def test_the_smallest_free_buffer_that_fits_is_lent():
    buffers = ReceiveBuffers()
    big, small = buffers.take(1500), buffers.take(1100)
    buffers.give_back(big)
    buffers.give_back(small)
    assert address(buffers.take(1000)) == address(small)
    assert address(buffers.take(1000)) == address(big)


def test_free_buffers_stay_within_the_limits_smallest_let_go_first():
    buffers = ReceiveBuffers(max_free=2, max_free_bytes=5000)
    a, b, c = buffers.take(1000), buffers.take(2000), buffers.take(3000)
    for buffer in (a, b, c):
        buffers.give_back(buffer)
    assert buffers.free_bytes == 5000  # a went (count), then nothing more (bytes)
    assert address(buffers.take(2000)) == address(b)
    buffers.give_back(buffers.take(6000))  # larger than the bytes kept at most: not kept
    assert buffers.free_bytes == 3000
    buffers.give_back(c)  # (given back twice: kept once)
    assert buffers.free_bytes == 3000


def test_clear_lets_every_free_buffer_go():
    buffers = ReceiveBuffers()
    buffers.give_back(buffers.take(4096))
    buffers.clear()
    assert buffers.free_bytes == 0
    buffers.take(4096)
    assert buffers.made == 2 and buffers.reused == 0
