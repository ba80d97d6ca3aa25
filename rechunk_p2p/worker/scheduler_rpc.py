"""Requests from a worker to the scheduler plugin: sent again over broken connections, and
their replies checked.

Where it runs: the worker's event loop (``scheduler_rpc``); ``checked`` and
``worker_closing`` anywhere.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.core import clean_exception
from distributed.protocol.pickle import dumps

from rechunk_p2p.errors import BROKEN_CONNECTION

logger = logging.getLogger("rechunk_p2p.worker.plugin")

#: How long a request to the scheduler is sent again while its connection keeps breaking.
RPC_RETRY_SECONDS = 30.0


def error_reply(error: BaseException) -> dict:
    """distributed's error reply for ``error``, pickled: whoever relays it (the scheduler
    passes a worker's barrier error on to the barrier task) need not import its type, and
    :func:`checked` raises it with its own type where it arrives."""
    return {
        "status": "error",
        "exception": dumps(error),
        "traceback": None,
        "exception_text": repr(error),
        "traceback_text": "",
    }


def checked(response: dict) -> dict:
    """An RPC reply, or its error raised with its own type."""
    if response.get("status") == "error":
        _, exc, tb = clean_exception(**response)
        assert exc is not None
        raise exc.with_traceback(tb)
    return response


async def scheduler_rpc(worker: Any, op: str, /, **kwargs: Any) -> Any:
    """On the worker loop: ``worker.scheduler.<op>(**kwargs)``, sent again when the
    connection broke under it (:data:`BROKEN_CONNECTION`), with backoff, for
    up to :data:`RPC_RETRY_SECONDS` and while the worker is not closing. Only for requests
    the scheduler can take twice (getting a run, a barrier, installing the plugin)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RPC_RETRY_SECONDS
    delay = 0.05
    while True:
        try:
            return await getattr(worker.scheduler, op)(**kwargs)
        except BROKEN_CONNECTION:
            if loop.time() > deadline or worker_closing(worker):
                raise
            logger.info("Request %s to the scheduler failed on a broken connection; again", op)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)


def worker_closing(worker: Any) -> bool:
    """Whether ``worker`` is closing or closed (its plugins are being taken down). A worker
    retiring gracefully is not: it still finishes its tasks, and their results move on."""
    status = getattr(getattr(worker, "status", None), "name", "running")
    return status in ("closing", "closed")
