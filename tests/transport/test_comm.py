"""The send side: batching, concurrency, back-pressure, retries, failure and close."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from distributed.utils_test import gen_test

from rechunk_p2p.errors import RechunkCommError, StaleRunError
from rechunk_p2p.transport.comm import CommBuffer, RetryPolicy
from rechunk_p2p.transport.limiter import ByteLimiter
from rechunk_p2p.transport.wire import Packed, pack_blocking

NO_RETRY_DELAY = RetryPolicy(count=3, delay_min=0.001, delay_max=0.002)


def piece(out: int, inp: int, nbytes: int = 100) -> Packed:
    """One packed piece of ``nbytes`` bytes."""
    return pack_blocking([(out, inp, np.full(nbytes, inp % 256, dtype="u1"))], np.dtype("u1"))


def put_all(comm: CommBuffer, items: dict[str, list[Packed]]):
    """Queue every item from a thread, one ``put_blocking`` per item (as many transfer tasks
    would)."""

    def run():
        for address, packed in items.items():
            for p in packed:
                comm.put_blocking({address: p})

    return asyncio.to_thread(run)


class Recorder:
    """A fake destination that records batches, optionally failing or blocking."""

    def __init__(self, fail_times: int = 0, error: type[Exception] = OSError) -> None:
        self.batches: list[tuple[str, list]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_times = fail_times
        self.error = error
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, address: str, batch: list) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.release.wait()
            await asyncio.sleep(0)
            if self.fail_times:
                self.fail_times -= 1
                raise self.error("injected")
            self.batches.append((address, batch))
        finally:
            self.in_flight -= 1


def make(send, limit=10_000, concurrency=2, message_bytes=250, retry=NO_RETRY_DELAY):
    limiter = ByteLimiter(limit)
    return CommBuffer(send, limiter, asyncio.Semaphore(concurrency), message_bytes, retry), limiter


@gen_test()
async def test_batches_respect_message_size_and_deliver_everything():
    send = Recorder()
    comm, limiter = make(send)
    await put_all(
        comm, {"a": [piece(0, i) for i in range(10)], "b": [piece(1, i) for i in range(3)]}
    )
    await comm.flush()
    delivered = {(addr, p.inputs[0]) for addr, batch in send.batches for p in batch}
    assert delivered == {("a", i) for i in range(10)} | {("b", i) for i in range(3)}
    assert all(sum(p.nbytes for p in batch) <= 250 for _, batch in send.batches)
    assert limiter.used == 0
    stats = comm.statistics()
    assert stats.bytes_sent == 1300 and stats.bytes_queued == 0
    assert stats.messages == len(send.batches)


@gen_test()
async def test_oversized_piece_is_sent_alone():
    send = Recorder()
    comm, limiter = make(send, limit=500, message_bytes=250)
    await put_all(comm, {"a": [piece(0, 0, 1000), piece(0, 1, 10)]})
    await comm.flush()
    assert [len(b) for _, b in send.batches] == [1, 1]
    assert limiter.used == 0


@gen_test()
async def test_concurrency_is_bounded():
    send = Recorder()
    send.release.clear()
    comm, _ = make(send, concurrency=2, message_bytes=100)  # each a message's worth
    await put_all(comm, {addr: [piece(0, 0)] for addr in "abcdef"})
    await asyncio.sleep(0.05)
    assert send.in_flight == 2
    send.release.set()
    await comm.flush()
    assert send.max_in_flight == 2
    assert len(send.batches) == 6


@gen_test()
async def test_put_waits_while_buffer_is_full():
    send = Recorder()
    send.release.clear()
    comm, limiter = make(send, limit=300, message_bytes=100)
    await put_all(comm, {"a": [piece(0, i) for i in range(3)]})
    assert limiter.used == 300
    blocked = asyncio.ensure_future(put_all(comm, {"a": [piece(0, 3)]}))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    send.release.set()
    await asyncio.wait_for(blocked, 5)
    await comm.flush()
    assert limiter.statistics().waits >= 1
    assert limiter.used == 0


@gen_test()
async def test_a_run_budget_holds_sends_back_within_the_worker_limit():
    send = Recorder()
    send.release.clear()
    worker, run = ByteLimiter(10_000), ByteLimiter(200)
    comm = CommBuffer(send, worker, asyncio.Semaphore(2), 100, NO_RETRY_DELAY, run_limiter=run)
    await put_all(comm, {"a": [piece(0, 0), piece(0, 1)]})
    assert (run.used, worker.used) == (200, 200)
    blocked = asyncio.ensure_future(put_all(comm, {"b": [piece(1, 2)]}))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # the run's budget is full, the worker's is not
    send.release.set()
    await asyncio.wait_for(blocked, 5)
    await comm.flush()
    assert (run.used, worker.used) == (0, 0)
    assert comm.statistics().max_bytes_queued == 200
    assert run.statistics().max_used == 200


@gen_test()
async def test_a_put_waiting_at_the_worker_limit_gives_the_run_budget_back_on_close():
    send = Recorder()
    send.release.clear()
    worker, run = ByteLimiter(100), ByteLimiter(10_000)
    comm = CommBuffer(send, worker, asyncio.Semaphore(2), 100, NO_RETRY_DELAY, run_limiter=run)
    await put_all(comm, {"a": [piece(0, 0)]})
    blocked = asyncio.ensure_future(put_all(comm, {"a": [piece(0, 1)]}))
    await asyncio.sleep(0.05)
    assert run.used == 200 and worker.used == 100  # waiting on the worker's limit
    assert not blocked.done()
    await comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(blocked, 5)
    assert (run.used, worker.used) == (0, 0)


@gen_test()
async def test_a_put_waiting_for_room_fails_with_the_send_error():
    """A thread waiting for room wakes with the error when a send fails for good."""
    send = Recorder(fail_times=100)
    send.release.clear()
    comm, limiter = make(send, limit=100, message_bytes=100)
    await put_all(comm, {"a": [piece(0, 0)]})
    blocked = asyncio.ensure_future(put_all(comm, {"a": [piece(0, 1)]}))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    send.release.set()
    with pytest.raises(RechunkCommError, match="injected"):
        await asyncio.wait_for(blocked, 5)
    assert limiter.used == 0


@gen_test()
async def test_transient_errors_are_retried():
    send = Recorder(fail_times=2)
    comm, _ = make(send)
    await put_all(comm, {"a": [piece(0, 0)]})
    await comm.flush()
    assert len(send.batches) == 1
    assert comm.statistics().retries == 2


@gen_test()
async def test_too_many_errors_fail_flush_and_later_puts():
    send = Recorder(fail_times=100)
    comm, limiter = make(send)
    await put_all(comm, {"a": [piece(0, i) for i in range(5)]})
    with pytest.raises(RechunkCommError, match="injected") as info:
        await comm.flush()
    assert isinstance(info.value.__cause__, OSError)  # the original error, kept as the cause
    with pytest.raises(RechunkCommError, match="injected"):
        await put_all(comm, {"a": [piece(0, 9)]})
    assert limiter.used == 0


@gen_test()
async def test_a_silent_peer_fails_within_the_deadline():
    """A send that never returns: the batch fails once its deadline passes, not later."""

    async def never(address, batch):
        await asyncio.sleep(3600)

    comm = CommBuffer(
        never,
        ByteLimiter(1 << 20),
        asyncio.Semaphore(2),
        message_bytes=1 << 20,
        retry=RetryPolicy(count=3, delay_min=0.01, delay_max=0.02, timeout=0.3),
        name="Rechunk r (run 1) on w",
    )
    await put_all(comm, {"a": [piece(0, 0)]})
    start = asyncio.get_running_loop().time()
    with pytest.raises(RechunkCommError, match=r"data plane at a within 0\.3 s"):
        await comm.flush()
    assert asyncio.get_running_loop().time() - start < 2


@gen_test()
async def test_permanent_errors_are_not_retried():
    send = Recorder(fail_times=1, error=ValueError)
    comm, _ = make(send)
    await put_all(comm, {"a": [piece(0, 0)]})
    with pytest.raises(ValueError, match="injected"):
        await comm.flush()
    assert comm.statistics().retries == 0


@gen_test()
async def test_close_drops_queue_and_releases_bytes():
    send = Recorder()
    send.release.clear()
    comm, limiter = make(send, concurrency=1, message_bytes=100)
    await put_all(comm, {"a": [piece(0, i) for i in range(5)]})
    assert limiter.used == 500
    await comm.close()
    assert limiter.used == 0
    with pytest.raises(RuntimeError, match="closed"):
        await put_all(comm, {"a": [piece(0, 7)]})
    # a flush after the queue was dropped must not report the pieces delivered
    with pytest.raises(StaleRunError, match="closed"):
        await comm.flush()


@gen_test()
async def test_forgetting_a_departed_peer_drops_its_pieces_and_its_failure():
    send = Recorder(fail_times=100)  # "gone" refuses every send
    comm, limiter = make(send, concurrency=1, message_bytes=100)
    await put_all(comm, {"gone": [piece(0, i) for i in range(3)]})
    with pytest.raises(RechunkCommError):
        await comm.flush()  # failed on it, for good
    comm.forget({"gone"})
    assert comm.phase.value == "sending" and limiter.used == 0
    send.fail_times = 0
    await put_all(comm, {"gone": [piece(0, 5)], "here": [piece(1, 5)]})
    await asyncio.wait_for(comm.flush(), 5)
    assert [address for address, _ in send.batches] == ["here"]  # nothing more for "gone"
    assert limiter.used == 0


@gen_test()
async def test_forgetting_a_peer_whose_sends_have_not_started_lets_flush_return():
    send = Recorder()
    comm, limiter = make(send)
    comm._enqueue("gone", piece(0, 1), 100)  # its drainer is created, not started yet
    limiter.acquire_blocking(100)  # (the bytes a put holds)
    comm.forget({"gone"})  # in the same loop turn: the drainer never runs
    await asyncio.wait_for(comm.flush(), 5)
    assert limiter.used == 0 and send.batches == []


@gen_test()
async def test_a_put_waiting_for_room_gives_up_when_the_worker_closes():
    send = Recorder()
    send.release.clear()  # sends stay in flight: the buffer stays full
    closing = False
    comm = CommBuffer(
        send,
        ByteLimiter(100),
        asyncio.Semaphore(1),
        100,
        NO_RETRY_DELAY,
        closing=lambda: closing,
    )
    await put_all(comm, {"a": [piece(0, 1)]})
    waiting = asyncio.ensure_future(put_all(comm, {"a": [piece(0, 2)]}))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    closing = True
    with pytest.raises(StaleRunError, match="worker is closing"):
        await asyncio.wait_for(waiting, 5)
    send.release.set()
    await comm.close()


@gen_test()
async def test_limiter_admits_oversized_request_when_empty():
    limiter = ByteLimiter(10)
    assert await asyncio.wait_for(asyncio.to_thread(limiter.acquire_blocking, 100), 1)
    assert limiter.used == 100
    waiter = asyncio.ensure_future(asyncio.to_thread(limiter.acquire_blocking, 1))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    limiter.release(100)
    assert await asyncio.wait_for(waiter, 1)
    assert limiter.statistics().max_used == 100
    assert limiter.statistics().waits == 1
    with pytest.raises(RuntimeError):
        limiter.release(5)


@gen_test()
async def test_limiter_waiter_gives_up_when_told_to_stop():
    limiter = ByteLimiter(10)
    limiter.acquire_blocking(10)
    stop = False
    waiter = asyncio.ensure_future(asyncio.to_thread(limiter.acquire_blocking, 5, lambda: stop))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    stop = True
    limiter.wake()
    assert await asyncio.wait_for(waiter, 1) is False
    assert limiter.used == 10  # nothing taken


def test_a_put_after_the_sending_loop_closed_fails_as_stale_and_holds_nothing():
    loop = asyncio.new_event_loop()
    limiter = ByteLimiter(1_000)
    comm = loop.run_until_complete(_make_on(loop, limiter))
    loop.close()  # the data plane's loop is gone (the worker is closing)
    with pytest.raises(StaleRunError, match="data plane stopped"):
        comm.put_blocking({"a": piece(0, 0)})
    assert limiter.used == 0


async def _make_on(loop, limiter):
    return CommBuffer(Recorder(), limiter, asyncio.Semaphore(1), 100, NO_RETRY_DELAY, loop=loop)


@gen_test()
async def test_pieces_are_staged_until_a_message_worth_and_go_at_the_barrier():
    send = Recorder()
    comm, limiter = make(send, message_bytes=1000)  # ten 100-byte pieces
    await put_all(comm, {"a": [piece(0, i) for i in range(9)]})
    await asyncio.sleep(0.05)
    assert send.batches == [] and comm.statistics().bytes_queued == 900  # staged, held
    assert limiter.used == 900
    await put_all(comm, {"a": [piece(0, 9)]})  # the tenth: a message's worth, one wake-up
    while not send.batches:
        await asyncio.sleep(0.01)
    await put_all(comm, {"a": [piece(0, 10)]})
    await asyncio.sleep(0.05)
    assert [len(b) for _, b in send.batches] == [10]  # one message of ten, the 11th waits
    await comm.flush()  # the barrier takes what is staged
    assert [len(b) for _, b in send.batches] == [10, 1] and limiter.used == 0


@gen_test()
async def test_a_destination_waits_for_a_message_worth_of_its_own():
    send = Recorder()
    comm, limiter = make(send, message_bytes=1000)
    # 1,800 bytes staged wake the loop; only a's queue makes a message
    await put_all(
        comm, {"a": [piece(0, i) for i in range(10)], "b": [piece(1, i) for i in range(4)]}
    )
    await put_all(comm, {"c": [piece(2, i) for i in range(4)]})
    while not send.batches:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert [(a, len(b)) for a, b in send.batches] == [("a", 10)]
    assert limiter.used == 800  # b's and c's, queued and held
    await comm.flush()  # the barrier sends the short queues, one message each
    assert sorted((a, len(b)) for a, b in send.batches) == [("a", 10), ("b", 4), ("c", 4)]
    assert limiter.used == 0 and comm.statistics().messages == 3
    # queues fill up to a message again after the barrier
    await put_all(comm, {"b": [piece(1, i) for i in range(4, 15)]})
    await asyncio.sleep(0.05)
    assert [len(b) for a, b in send.batches if a == "b"] == [4, 10]
    await comm.flush()
    assert [len(b) for a, b in send.batches if a == "b"] == [4, 10, 1]


@gen_test()
async def test_a_thread_waiting_for_room_hands_on_what_any_buffer_staged():
    send = Recorder()
    limiter = ByteLimiter(500)
    one, other = (
        CommBuffer(send, limiter, asyncio.Semaphore(2), 10_000, NO_RETRY_DELAY) for _ in "12"
    )
    await put_all(one, {"a": [piece(0, i) for i in range(5)]})  # the limit, all staged
    assert limiter.used == 500 and send.batches == []
    # the other run's put must wait for room: the staged pieces go, their bytes come back
    # (b's own piece may go at once too: the waiting thread presses every buffer until it
    # has room, and may press again after it staged it)
    await asyncio.wait_for(put_all(other, {"b": [piece(1, 0)]}), 5)
    assert [len(b) for a, b in send.batches if a == "a"] == [5]
    await other.flush()
    await one.flush()
    assert limiter.used == 0 and len([p for _, b in send.batches for p in b]) == 6
    await one.close()
    await other.close()
    # closed buffers are no longer asked to hand on
    assert limiter._before_wait == []


@gen_test()
async def test_a_failure_keeps_the_other_peers_pieces_unheld_and_forgetting_sends_them():
    delivered: list[int] = []
    go, failed = asyncio.Event(), asyncio.Event()

    async def send(address: str, batch: list) -> None:
        await go.wait()  # every piece is queued first
        if address == "gone":
            failed.set()
            raise ValueError("injected: gone for good")  # permanent: not retried
        await failed.wait()  # b's sends are still queued when the buffer fails
        delivered.extend(p.inputs[0] for p in batch)

    comm, limiter = make(send, concurrency=1, message_bytes=100)  # every piece due at once
    await put_all(comm, {"gone": [piece(0, 0)], "b": [piece(1, i) for i in range(4)]})
    go.set()
    with pytest.raises(ValueError, match="gone for good"):
        await comm.flush()
    assert limiter.used == 0  # nothing held while failed: other runs' threads go on
    assert len(delivered) < 4
    comm.forget({"gone"})  # the run goes on without it: what waited for b goes now
    await comm.flush()
    assert sorted(delivered) == [0, 1, 2, 3] and limiter.used == 0


@gen_test()
async def test_close_drops_what_is_staged_and_a_put_racing_it_holds_nothing():
    send = Recorder()
    comm, limiter = make(send, message_bytes=10_000)
    await put_all(comm, {"a": [piece(0, i) for i in range(3)]})
    assert limiter.used == 300
    await comm.close()
    assert limiter.used == 0 and send.batches == []
    # a thread that held its bytes before the close and stages after it
    assert limiter.acquire_blocking(100)
    with comm._inbox_lock:
        comm._inbox.append(("a", piece(0, 9), 100))
        comm._inbox_bytes += 100
    comm._hand_on()
    await asyncio.sleep(0.05)
    assert limiter.used == 0 and send.batches == []
