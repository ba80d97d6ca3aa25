"""The send side of a run: batches packed pieces per destination, sends with back-pressure.

Where it runs: the data plane's event loop, but for ``CommBuffer.put_blocking``, which task
threads call. Pieces arrive already cut and packed (task threads do that, see
:mod:`rechunk_p2p.transport.wire`); a thread holds their bytes under the limits and hands them to
the loop without waiting for it; the loop only queues, batches and awaits sends.

A destination's pieces wait until they make a message (``message_bytes``), so that a worker
sends about as many messages to each peer as the bytes between them need, however many peers
share its buffer (each message costs both ends a fixed amount of loop and system time). Short
queues go at the barrier (:meth:`CommBuffer.flush`), and whenever a thread must wait for
room under a limit: then every queue goes, until the queues are empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from rechunk_p2p.errors import RechunkCommError, RechunkRunError, StaleRunError
from rechunk_p2p.transport.limiter import ByteLimiter
from rechunk_p2p.transport.wire import Packed

logger = logging.getLogger(__name__)

SendFn = Callable[[str, list[Packed]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """**Immutable.** How often and how patiently a failed send is tried again.

    ``timeout`` bounds one batch's delivery, every attempt included: a peer that refuses,
    drops or never answers fails the rechunk within it.
    """

    count: int = 5
    delay_min: float = 0.1
    delay_max: float = 5.0
    timeout: float = 30.0

    def delay(self, attempt: int) -> float:
        """Exponential backoff with jitter for the given (1-based) attempt."""
        base = min(self.delay_min * 2 ** (attempt - 1), self.delay_max)
        return base * (0.5 + random.random() / 2)


#: The retries of every send (the timeout comes from ``rechunk-p2p.comm.timeout``)
RETRY = RetryPolicy()


class SendPhase(enum.Enum):
    """Where a :class:`CommBuffer` is. Changed only by ``CommBuffer._set_phase``, along
    :data:`_NEXT_PHASE`: a failed buffer stays failed until closed, unless the peer it failed
    on is forgotten (it left the run); closed is final."""

    SENDING = "sending"
    FAILED = "failed"  # a send failed for good: ``put`` and ``flush`` raise its error
    CLOSED = "closed"  # the run ended: sends stopped, queues dropped


_NEXT_PHASE: dict[SendPhase, frozenset[SendPhase]] = {
    SendPhase.SENDING: frozenset({SendPhase.FAILED, SendPhase.CLOSED}),
    SendPhase.FAILED: frozenset({SendPhase.SENDING, SendPhase.CLOSED}),
    SendPhase.CLOSED: frozenset({SendPhase.CLOSED}),
}


@dataclass(frozen=True, slots=True)
class CommStatistics:
    """**Immutable.** What a :class:`CommBuffer` has sent."""

    bytes_sent: int
    messages: int
    retries: int
    bytes_queued: int
    max_bytes_queued: int = 0
    send_seconds: float = 0.0  # summed over concurrent sends


class CommBuffer:
    """**Loop-confined** (to ``loop``), but for :meth:`put_blocking`, which task threads
    call. Per-destination queues of packed pieces, sent in bounded batches.

    Parameters
    ----------
    send
        ``await send(address, batch)`` delivers one batch of :class:`Packed`; it raises
        ``OSError`` on transient comm errors (retried) and anything else on permanent ones.
    limiter
        Shared byte limit of everything queued on this worker; ``put_blocking`` waits on it.
    concurrency
        Shared bound of sends in flight on this worker.
    message_bytes
        Largest batch sent in one message (a single larger item is sent alone), and what a
        destination's queue holds before it is sent.
    retry
        Retry policy for transient errors, and the deadline of a batch's delivery.
    name
        Names the run and the sending worker in errors.
    run_limiter
        This run's own byte limit (its share of a memory budget), acquired before
        ``limiter``; ``None``: the worker's limit alone.
    loop
        The loop that sends (the data plane's); default: the running loop.
    closing
        Whether the worker is closing: a thread waiting for room gives up then (the worker's
        close waits for its task threads, and the run closes only after them).
    """

    def __init__(
        self,
        send: SendFn,
        limiter: ByteLimiter,
        concurrency: asyncio.Semaphore,
        message_bytes: int,
        retry: RetryPolicy,
        name: str = "rechunk_p2p",
        run_limiter: ByteLimiter | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._loop = asyncio.get_running_loop() if loop is None else loop
        self._closing = closing
        self._name = name
        self._send = send
        self._limiters = (limiter,) if run_limiter is None else (run_limiter, limiter)
        self._concurrency = concurrency
        self._message_bytes = message_bytes
        self._retry = retry
        self._queues: defaultdict[str, deque[tuple[Packed, int]]] = defaultdict(deque)
        self._queue_bytes: defaultdict[str, int] = defaultdict(int)  # payload bytes a queue
        self._eager = False  # every queue goes, not only full ones: until they are empty
        self._drainers: dict[str, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._phase = SendPhase.SENDING
        self._exception: BaseException | None = None  # set with FAILED
        self._failed_on: str | None = None  # the address whose send failed, with FAILED
        self._departed: set[str] = set()  # peers that left the run: their pieces are dropped
        self._bytes_queued = 0
        self._max_bytes_queued = 0
        self._send_seconds = 0.0
        self._bytes_sent = 0
        self._messages = 0
        self._retries = 0
        # pieces put by task threads, staged until a message's worth is there (or until
        # the barrier, a thread waits for room, or the buffer stops)
        self._inbox: deque[tuple[str, Packed, int]] = deque()
        self._inbox_lock = threading.Lock()
        self._inbox_bytes = 0
        self._take_scheduled = False
        self._press = False  # a thread waits for room: the loop sends every queue
        for limiter in self._limiters:
            limiter.add_before_wait(self._hand_on_quietly)

    def put_blocking(self, batches: Mapping[str, Packed] | Iterable[tuple[str, Packed]]) -> None:
        """From a task thread: queue packed pieces per destination.

        Holds their bytes under the run's and the worker's limits first, waiting only while
        a buffer is full; then stages them for the loop without waiting for it. The loop is
        woken once a message's worth (``message_bytes``) is staged, not for every input
        chunk: each wake-up costs the thread a self-pipe write and a wait for the GIL while
        the loop runs, and a message per input chunk is many small sends. What is staged
        also goes when a thread must wait for room (:meth:`ByteLimiter.add_before_wait`),
        at the barrier (:meth:`flush`), and when the buffer stops.
        """
        for address, packed in batches.items() if isinstance(batches, Mapping) else batches:
            self._raise_if_unusable()
            nbytes = packed.nbytes
            while not self._acquire_blocking(nbytes):
                self._raise_if_unusable()
                if self._closing():
                    raise StaleRunError(
                        f"{self._name}: the worker is closing; its sends are dropped"
                    )
                # else a failure on a departed peer was forgotten meanwhile: wait again
            with self._inbox_lock:
                self._inbox.append((address, packed, nbytes))
                self._inbox_bytes += nbytes
                due = self._inbox_bytes >= self._message_bytes
            # stopped meanwhile: the loop must still drop the pieces and give their bytes back
            if due or self._phase is not SendPhase.SENDING:
                self._hand_on()

    def _hand_on(self, press: bool = False) -> None:
        """From a thread: have the loop take the staged pieces (one wake-up for all);
        ``press``: and send every queue, full or not."""
        with self._inbox_lock:
            self._press |= press
            if self._take_scheduled or not (self._inbox or press):
                return
            self._take_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._take_inbox)
        except RuntimeError:  # the data plane's loop is closed: the worker is going
            for _, _, nbytes in self._empty_inbox()[0]:
                self._release(nbytes)
            raise StaleRunError(
                f"{self._name}: the data plane stopped; its sends are dropped"
            ) from None

    def _hand_on_quietly(self) -> None:
        """The limiters' hook, from a thread about to wait for room: what this buffer holds
        must go, or the wait could be for bytes that wait for more bytes."""
        with contextlib.suppress(StaleRunError):
            self._hand_on(press=True)

    def _empty_inbox(self) -> tuple[list[tuple[str, Packed, int]], bool]:
        with self._inbox_lock:
            self._take_scheduled = False
            items = list(self._inbox)
            self._inbox.clear()
            self._inbox_bytes = 0
            press, self._press = self._press, False
        return items, press

    def _take_inbox(self) -> None:
        """On the loop: queue what threads staged (and send every queue if one pressed)."""
        items, press = self._empty_inbox()
        for address, packed, nbytes in items:
            self._enqueue(address, packed, nbytes)
        if press:
            self._send_all()

    def _send_all(self) -> None:
        """On the loop: send every queue, full or not, until all are empty."""
        if not any(self._queues.values()):
            return  # (nothing waits: later pieces wait for a message's worth again)
        self._eager = True
        if self._phase is SendPhase.SENDING:
            for address in list(self._queues):
                self._ensure_drainer(address)

    def _due(self, address: str) -> bool:
        return self._eager or self._queue_bytes[address] >= self._message_bytes

    def _acquire_blocking(self, nbytes: int) -> bool:
        """Hold ``nbytes`` under every limiter, in order; ``False``, holding nothing, when
        the buffer stopped sending meanwhile."""
        stop = self._stopped
        for i, limiter in enumerate(self._limiters):
            if not limiter.acquire_blocking(nbytes, stop):
                for taken in self._limiters[:i]:
                    taken.release(nbytes)
                return False
        if stop():
            self._release(nbytes)
            return False
        return True

    def _stopped(self) -> bool:
        return self._phase is not SendPhase.SENDING or self._closing()

    def _release(self, nbytes: int) -> None:
        for limiter in self._limiters:
            limiter.release(nbytes)

    def _enqueue(self, address: str, packed: Packed, nbytes: int) -> None:
        """On the loop: queue bytes a thread holds; dropped if the buffer closed or the peer
        left meanwhile (kept, not sent, while the buffer is failed: see :meth:`forget`)."""
        if self._phase is SendPhase.CLOSED or address in self._departed:
            self._release(nbytes)
            return
        if self._phase is SendPhase.FAILED:  # kept, not held (see _set_phase)
            self._release(nbytes)
            nbytes = 0
        self._queues[address].append((packed, nbytes))
        self._queue_bytes[address] += packed.nbytes
        self._bytes_queued += nbytes
        self._max_bytes_queued = max(self._max_bytes_queued, self._bytes_queued)
        if self._phase is SendPhase.SENDING and self._due(address):
            self._ensure_drainer(address)

    @property
    def phase(self) -> SendPhase:
        return self._phase

    def _set_phase(self, phase: SendPhase, error: BaseException | None = None) -> None:
        if phase not in _NEXT_PHASE[self._phase]:
            raise RechunkRunError(f"{self._name}: send buffer cannot go {self._phase} -> {phase}")
        if phase is SendPhase.FAILED:
            self._exception = error
            # pieces queued for the other peers are kept (the failure may be forgotten: see
            # forget) but no longer held under the limits, which threads of other runs wait
            # on; they are sent, or dropped when the buffer closes
            for queue in self._queues.values():
                held = sum(nbytes for _, nbytes in queue)
                for i, (packed, _) in enumerate(queue):
                    queue[i] = (packed, 0)
                self._bytes_queued -= held
                self._release(held)
        elif phase is SendPhase.SENDING:
            self._exception = self._failed_on = None
        self._phase = phase
        if phase is not SendPhase.SENDING:
            for limiter in self._limiters:
                limiter.wake()  # threads waiting for room give up

    def _raise_if_unusable(self) -> None:
        if self._exception is not None:
            raise self._exception
        if self._phase is SendPhase.CLOSED:
            raise StaleRunError(f"{self._name}: the run was closed; its sends are dropped")

    def _ensure_drainer(self, address: str) -> None:
        if address not in self._drainers and self._queues[address]:
            self._idle.clear()
            self._drainers[address] = asyncio.create_task(self._drain(address))

    async def _drain(self, address: str) -> None:
        queue = self._queues[address]
        try:
            while queue and self._phase is SendPhase.SENDING and self._due(address):
                batch, nbytes = self._take_batch(address)
                try:
                    async with self._concurrency:
                        start = time.perf_counter()
                        try:
                            await self._send_with_retries(address, batch)
                        finally:
                            self._send_seconds += time.perf_counter() - start
                    self._bytes_sent += nbytes
                    self._messages += 1
                except Exception as e:
                    # failed before the bytes are given back: a thread they wake sees it
                    if self._phase is SendPhase.SENDING and address not in self._departed:
                        self._set_phase(SendPhase.FAILED, e)
                        self._failed_on = address
                finally:
                    self._bytes_queued -= nbytes
                    self._release(nbytes)
        finally:
            if self._drainers.get(address) is asyncio.current_task():
                del self._drainers[address]  # (forget and close take it out themselves)
            # failed: the other peers' pieces wait (the failure may be forgotten, see
            # forget); closed: dropped
            if self._phase is SendPhase.CLOSED:
                self._drop(address)
            if not self._drainers:
                if not any(self._queues.values()):
                    self._eager = False  # all went: queues fill up to a message again
                self._idle.set()

    def _take_batch(self, address: str) -> tuple[list[Packed], int]:
        """The next message for ``address``: up to ``message_bytes`` (one item at least)."""
        queue = self._queues[address]
        batch: list[Packed] = []
        total = size = 0
        while queue and (not batch or size + queue[0][0].nbytes <= self._message_bytes):
            item, nbytes = queue.popleft()
            batch.append(item)
            total += nbytes
            size += item.nbytes
        self._queue_bytes[address] -= size
        return batch, total

    def _drop(self, address: str) -> None:
        queue = self._queues.pop(address, deque())
        self._queue_bytes.pop(address, None)
        dropped = sum(nbytes for _, nbytes in queue)
        queue.clear()
        self._bytes_queued -= dropped
        self._release(dropped)

    async def _send_with_retries(self, address: str, batch: list[Packed]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry.timeout
        attempt = 0
        while True:
            try:
                remaining = max(deadline - loop.time(), 0.001)
                return await asyncio.wait_for(self._send(address, batch), remaining)
            except asyncio.TimeoutError:
                raise self._undeliverable(address, "no answer") from None
            except OSError as e:
                attempt += 1
                delay = self._retry.delay(attempt)
                if self._phase is SendPhase.CLOSED:
                    raise
                if attempt > self._retry.count or loop.time() + delay >= deadline:
                    raise self._undeliverable(address, f"{type(e).__name__}: {e}") from e
                self._retries += 1
                logger.info("Send to %s failed (%s); retry %d in %.2fs", address, e, attempt, delay)
                await asyncio.sleep(delay)

    def _undeliverable(self, address: str, why: str) -> RechunkCommError:
        return RechunkCommError(
            f"{self._name}: cannot deliver pieces to the data plane at {address} within "
            f"{self._retry.timeout:g} s ({why}); is that worker reachable on its data-plane "
            "port? (rechunk-p2p.comm.timeout, rechunk-p2p.dataplane.port)"
        )

    async def flush(self) -> None:
        """Wait until everything queued was delivered; raise the first send error, if any,
        and :class:`StaleRunError` if the buffer was closed meanwhile (its queue dropped)."""
        self._take_inbox()
        self._send_all()  # the short queues too
        while self._drainers:
            await self._idle.wait()
        self._raise_if_unusable()

    def forget(self, addresses: set[str]) -> None:
        """Peers that left the run: drop what is queued for them, stop sending to them, and
        drop what is put for them later. A failure to reach one of them is forgotten too
        (the run goes on without them; their pieces are sent to other workers instead)."""
        self._departed |= addresses
        self._take_inbox()  # (theirs are dropped as they are queued)
        for address in addresses:
            # a drainer cancelled before it started never runs its finally: take it out here
            # (one that started gives its in-flight batch's bytes back as it stops)
            drainer = self._drainers.pop(address, None)
            if drainer is not None:
                drainer.cancel()
            self._drop(address)
        if not self._drainers:
            self._idle.set()
        if self._phase is SendPhase.FAILED and self._failed_on in addresses:
            self._set_phase(SendPhase.SENDING)
            self._send_all()  # what waited for the others goes now

    async def close(self) -> None:
        """Stop sending, drop what is queued and give its bytes back to the limiter."""
        self._set_phase(SendPhase.CLOSED)
        for limiter in self._limiters:
            limiter.remove_before_wait(self._hand_on_quietly)  # (bound methods compare equal)
        self._take_inbox()  # dropped, their bytes given back
        drainers = list(self._drainers.values())
        self._drainers.clear()  # (those cancelled before they started never clear themselves)
        for task in drainers:
            task.cancel()
        await asyncio.gather(*drainers, return_exceptions=True)
        for address in list(self._queues):
            self._drop(address)
        self._idle.set()

    def statistics(self) -> CommStatistics:
        return CommStatistics(
            self._bytes_sent,
            self._messages,
            self._retries,
            self._bytes_queued + self._inbox_bytes,
            self._max_bytes_queued,
            self._send_seconds,
        )
