"""The data plane: a worker's piece traffic on an event loop of its own.

Where it runs: the data plane's event loop, in a dedicated thread of each worker process.

Bulk bytes never touch the worker's own event loop: pieces are sent through a
:class:`distributed.core.ConnectionPool` and received by a listener that both live on this
loop, with the worker's security settings (so TLS still applies). Reading large messages off
sockets therefore delays this loop, not the one that answers heartbeats and schedules tasks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from distributed.comm import listen
from distributed.comm.addressing import get_address_host, parse_address
from distributed.core import ConnectionPool, error_message
from distributed.protocol import to_serialize

from rechunk_p2p.errors import ClusterError
from rechunk_p2p.offload import LoopThread, from_thread
from rechunk_p2p.spec import RunId, ShuffleId
from rechunk_p2p.transport.limiter import ByteLimiter
from rechunk_p2p.transport.wire import Packed

logger = logging.getLogger(__name__)

ReceiveFn = Callable[[str, int, list[Packed]], Awaitable[None]]
PIECES_OP = "rechunk_p2p_pieces"


#: Outgoing connections a data plane keeps open at once (idle ones are reused per peer). Sends
#: in flight are bounded by ``rechunk-p2p.comm.concurrency``; this bounds the file descriptors
#: kept for a cluster of many workers, as distributed's own pool does.
_OPEN_CONNECTIONS = 512


class DataPlane:
    """**Loop-confined** (its own loop), with blocking lifecycle methods for other threads.
    Listener, connection pool and send limits of one worker's piece traffic.

    ``start_blocking`` and ``stop_blocking`` are called from any thread but the data plane's
    loop (they hop onto it and wait); every other method and attribute belongs to the data
    plane's loop (``address`` is written once, before ``start_blocking`` returns).

    Parameters
    ----------
    worker_address
        The worker's own address; the data plane listens on the same host and scheme
        (``inproc`` workers use TCP on localhost).
    security
        The worker's :class:`distributed.Security`.
    receive
        ``await receive(shuffle_id, run_id, batch)``, run on this loop for every message.
    buffer_bytes
        Bytes queued for sending before transfer tasks are held back.
    concurrency
        Sends in flight at once.
    ports
        Ports to listen on, the first free one taken (default: any free port).
    """

    def __init__(
        self,
        worker_address: str,
        security: Any,
        receive: ReceiveFn,
        *,
        buffer_bytes: int,
        concurrency: int,
        ports: range | None = None,
    ) -> None:
        self._ports = ports or range(0, 1)
        self._worker_address = worker_address
        self._security = security
        self._receive = receive
        self._thread = LoopThread(f"rechunk-p2p-dataplane-{worker_address}")
        self.limiter = ByteLimiter(buffer_bytes)
        self._sends_in_flight = concurrency
        self.send_slots: asyncio.Semaphore | None = None  # made on the loop, in _start
        self.address: str | None = None
        self._listener: Any = None
        self._pool: ConnectionPool | None = None
        self._inbound: set[Any] = set()
        self._stopping = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._thread.loop

    def start_blocking(self) -> str:
        """Start the loop thread, listen, and return the data plane's address."""
        self._thread.start_blocking()
        return from_thread(self.loop, self._start)

    async def _start(self) -> str:
        scheme, _ = parse_address(self._worker_address)
        if scheme not in ("tcp", "tls"):
            scheme = "tcp"
        host = get_address_host(self._worker_address) if scheme != "inproc" else "127.0.0.1"
        listen_args = self._security.get_listen_args("worker")
        error: OSError | None = None
        for port in self._ports:
            if port and (error := _bind_error(host, port)) is not None:
                continue  # taken (tornado would leak its socket on this failure)
            self._listener = listen(f"{scheme}://{host}:{port}", self._handle_comm, **listen_args)
            try:
                await self._listener.start()
                break
            except OSError as e:  # taken: try the next port of the range
                error = e
        else:
            raise ClusterError(
                f"The rechunk_p2p data plane of {self._worker_address} found no free port in "
                f"{self._ports.start}-{self._ports.stop - 1} (rechunk-p2p.dataplane.port): {error}"
            )
        self._pool = ConnectionPool(
            limit=_OPEN_CONNECTIONS, connection_args=self._security.get_connection_args("worker")
        )
        await self._pool.start()
        self.send_slots = asyncio.Semaphore(self._sends_in_flight)
        self.address = self._listener.contact_address
        return self.address

    def stop_blocking(self) -> None:
        """Close the listener and the pool, then stop the loop thread."""
        try:
            from_thread(self.loop, self._stop, timeout=10)
        except Exception:  # the loop may already be gone at interpreter exit
            logger.debug("Data plane did not stop cleanly", exc_info=True)
        self._thread.stop_blocking()

    async def _stop(self) -> None:
        self._stopping = True
        if self._listener is not None:
            self._listener.stop()
        for comm in list(self._inbound):  # peers may still hold their connections open
            comm.abort()
        if self._pool is not None:
            await self._pool.close()

    def idle_connections(self) -> int:
        """Outgoing connections open but unused (read from any thread: a count, maybe a
        step behind)."""
        pool = self._pool
        return 0 if pool is None else sum(len(c) for c in list(pool.available.values()))

    async def close_idle(self) -> None:
        """On this loop: close the outgoing connections no send uses (the worker is idle);
        the next send opens what it needs."""
        if self._pool is not None:
            self._pool.collect()

    async def send(
        self, address: str, shuffle_id: ShuffleId, run_id: RunId, batch: list[Packed]
    ) -> None:
        """Deliver one batch of packed pieces to the data plane at ``address``; await its ack.

        Each :class:`Packed` travels as a header (three lists of small integers, one entry
        per piece, msgpack-encoded on this loop) and one payload frame. The frame's bytes never
        pass through Python here; the header costs this loop a few hundred nanoseconds per
        piece, which is why transfer tasks pack all of an input chunk's pieces for one worker
        into one :class:`Packed`.
        """
        assert self._pool is not None
        await getattr(self._pool(address), PIECES_OP)(
            shuffle_id=shuffle_id,
            run_id=run_id,
            headers=[p.header() for p in batch],
            payloads=[to_serialize(p.payload) for p in batch],
        )

    async def _handle_comm(self, comm: Any) -> None:
        if self._stopping:  # accepted as the data plane stopped: no one would close it
            comm.abort()
            return
        self._inbound.add(comm)
        try:
            while True:
                msg = await comm.read()
                reply = await self._dispatch(msg)
                await comm.write(reply)
        except OSError:  # the sender closed its connection
            pass
        finally:
            self._inbound.discard(comm)
            await comm.close()

    async def _dispatch(self, msg: dict) -> Any:
        op = msg.get("op")
        if op == "close":
            raise OSError("closed by peer")
        if op != PIECES_OP:
            return error_message(ValueError(f"Unknown data plane operation {op!r}"))
        try:
            batch = [Packed.from_message(h, p) for h, p in zip(msg["headers"], msg["payloads"])]
            await self._receive(msg["shuffle_id"], msg["run_id"], batch)
        except Exception as e:
            return error_message(e)
        return {"status": "OK"}


def _bind_error(host: str, port: int) -> OSError | None:
    """Why ``port`` on ``host`` cannot be bound now (as the listener would), or ``None``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e
    return None
