"""Crossing between event loops and threads: the only module that owns executors.

Where it runs: helpers called on an event loop (``to_thread``, ``on_loop``) or from a thread
(``from_thread``). The direction of each hop is in its name:

- ``OffloadPool.to_thread(fn, ...)``: from an event loop, run a blocking ``*_blocking`` function
  on a named, bounded thread pool and await its result.
- ``from_thread(loop, coro_fn, ...)``: from a task or pool thread, run a coroutine on ``loop``
  and block until it is done.
- ``on_loop(loop, coro_fn, ...)``: from one event loop, run a coroutine on another loop (for
  example the worker's loop and the data plane's loop) and await it without blocking.
- ``OffloadPool.submit(fn, ...)``: from a thread, run ``fn`` on the pool (a worker's store
  I/O pool runs its disk stores' background writes and parallel reads this way: a store
  starts no thread of its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ParamSpec, TypeVar

from rechunk_p2p.errors import RechunkRunError

P = ParamSpec("P")
T = TypeVar("T")


class OffloadPool:
    """**Thread-safe (guarded by the executor).** A bounded, named pool for blocking work.

    Parameters
    ----------
    n_threads
        Number of threads.
    name
        Prefix of the threads' names (shown by ``py-spy dump``).
    """

    def __init__(self, n_threads: int, name: str = "rechunk-p2p-offload") -> None:
        self.n_threads = max(int(n_threads), 1)
        self.name = name
        self._executor = ThreadPoolExecutor(self.n_threads, thread_name_prefix=name)

    async def to_thread(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """From an event loop: run ``fn`` on the pool and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    def submit(
        self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        """From a thread: run ``fn`` on the pool; its future."""
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting work; with ``wait``, let queued work finish first."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


def from_thread(
    loop: asyncio.AbstractEventLoop,
    coro_fn: Callable[..., Awaitable[T]],
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> T:
    """From a thread (never the loop's own): run ``coro_fn(*args)`` on ``loop``, block for it."""
    if _running_loop() is loop:
        raise RechunkRunError("from_thread() was called on the loop it would block")
    return _submit(loop, coro_fn, args, kwargs).result(timeout)


async def on_loop(
    loop: asyncio.AbstractEventLoop, coro_fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
) -> T:
    """From one event loop: run ``coro_fn(*args)`` on ``loop`` and await it."""
    if asyncio.get_running_loop() is loop:
        return await coro_fn(*args, **kwargs)
    return await asyncio.wrap_future(_submit(loop, coro_fn, args, kwargs))


def _submit(
    loop: asyncio.AbstractEventLoop,
    coro_fn: Callable[..., Awaitable[T]],
    args: tuple,
    kwargs: dict,
) -> concurrent.futures.Future[T]:
    """Schedule ``coro_fn(*args, **kwargs)`` on ``loop``; a loop that is closed raises
    ``RuntimeError`` and leaves no coroutine behind never awaited."""
    coro = _call(coro_fn, *args, **kwargs)
    try:
        return asyncio.run_coroutine_threadsafe(coro, loop)
    except BaseException:
        coro.close()
        raise


async def _call(coro_fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    return await coro_fn(*args, **kwargs)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class LoopThread:
    """**Thread-safe (guarded by ``_ready``).** An asyncio event loop running in its own thread.

    Parameters
    ----------
    name
        The thread's name.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RechunkRunError(f"{self.name} is not running")
        return self._loop

    def start_blocking(self) -> None:
        """Start the thread and wait until its loop runs."""
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        loop.call_soon(self._ready.set)
        try:
            loop.run_forever()
        finally:
            # as asyncio.run does: what is still pending (a connection handler that started
            # as the loop stopped) is cancelled and runs its cleanup before the loop closes
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop_blocking(self, timeout: float = 10) -> None:
        """Stop the loop (after pending callbacks) and join the thread."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
