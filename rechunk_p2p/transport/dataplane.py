"""The data plane: a worker's piece traffic on an event loop of its own.

Where it runs: the data plane's event loop, in a dedicated thread of each worker process.

Bulk bytes never touch the worker's own event loop: pieces are sent on streams this loop
keeps per peer and received by a listener on the same loop
(:mod:`rechunk_p2p.transport.streams`), with the worker's security settings (so TLS still
applies). Reading large messages off sockets therefore delays this loop, not the one that
answers heartbeats and schedules tasks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import dask.config
from distributed.comm.addressing import get_address_host, parse_address, unparse_host_port

from rechunk_p2p.errors import ClusterError
from rechunk_p2p.offload import LoopThread, from_thread
from rechunk_p2p.spec import RunId, ShuffleId
from rechunk_p2p.transport.limiter import ByteLimiter
from rechunk_p2p.transport.receive_buffers import ReceiveBuffers
from rechunk_p2p.transport.streams import PieceServer, StreamPool, request_frames
from rechunk_p2p.transport.wire import Packed

logger = logging.getLogger(__name__)

#: ``await receive(shuffle_id, run_id, batch)``: stores the pieces, returns whether it
#: copied them out (see :data:`rechunk_p2p.transport.streams.Handler`)
ReceiveFn = Callable[[ShuffleId, RunId, list[Packed]], Awaitable[bool]]


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
        ``await receive(shuffle_id, run_id, batch)``, run on this loop for every message;
        returns whether it copied the pieces out (their payload's buffer then serves a
        later message).
    buffer_bytes
        Bytes queued for sending before transfer tasks are held back.
    concurrency
        Sends in flight at once.
    ports
        Ports to listen on, the first free one taken (default: any free port).
    connections
        Outgoing connections kept open at most (idle ones are reused per peer; sends in
        flight, bounded by ``concurrency``, may open one past it).
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
        connections: int = 512,
    ) -> None:
        self._ports = ports or range(0, 1)
        self._connections = connections
        self._worker_address = worker_address
        self._security = security
        self._receive = receive
        self._thread = LoopThread(f"rechunk-p2p-dataplane-{worker_address}")
        self.limiter = ByteLimiter(buffer_bytes)
        self._sends_in_flight = concurrency
        self.send_slots: asyncio.Semaphore | None = None  # made on the loop, in _start
        self.address: str | None = None
        self._server: PieceServer | None = None
        self._pool: StreamPool | None = None

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
        tls = scheme == "tls"
        server_tls = self._security.get_listen_args("worker").get("ssl_context") if tls else None
        client_tls = (
            self._security.get_connection_args("worker").get("ssl_context") if tls else None
        )
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        server = PieceServer(self._receive, server_tls)
        error: OSError | None = None
        for port in self._ports:
            if port and (error := _bind_error(host, port)) is not None:
                continue  # taken (binding it would leave a socket behind)
            try:
                port = server.listen_on(host, port, backlog)
                break
            except OSError as e:  # taken meanwhile: try the next port of the range
                error = e
        else:
            raise ClusterError(
                f"The rechunk_p2p data plane of {self._worker_address} found no free port in "
                f"{self._ports.start}-{self._ports.stop - 1} (rechunk-p2p.dataplane.port): {error}"
            )
        self._server = server
        self._pool = StreamPool(self._connections, client_tls)
        self.send_slots = asyncio.Semaphore(self._sends_in_flight)
        self.address = f"{scheme}://{unparse_host_port(host, port)}"
        return self.address

    def stop_blocking(self) -> None:
        """Close the listener and the pool, then stop the loop thread."""
        try:
            from_thread(self.loop, self._stop, timeout=10)
        except Exception:  # the loop may already be gone at interpreter exit
            logger.debug("Data plane did not stop cleanly", exc_info=True)
        self._thread.stop_blocking()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.stop_all()
        if self._pool is not None:
            self._pool.close()

    def idle_connections(self) -> int:
        """Outgoing connections open but unused (read from any thread: a count, maybe a
        step behind)."""
        pool = self._pool
        return 0 if pool is None else pool.idle

    @property
    def receive_buffers(self) -> ReceiveBuffers | None:
        """The buffers received payloads are read into (``None`` before the start)."""
        return None if self._server is None else self._server.buffers

    def free_buffer_bytes(self) -> int:
        """Bytes of receive buffers kept free for the next payloads (read from any thread:
        maybe a step behind)."""
        buffers = self.receive_buffers
        return 0 if buffers is None else buffers.free_bytes

    async def close_idle(self) -> None:
        """On this loop: close the outgoing connections no send uses (the worker has long
        been idle); the next send opens what it needs."""
        if self._pool is not None:
            self._pool.close_idle()

    async def let_buffers_go(self) -> None:
        """On this loop: let the free receive buffers go (the worker is idle)."""
        if (buffers := self.receive_buffers) is not None:
            buffers.clear()

    async def send(
        self, address: str, shuffle_id: ShuffleId, run_id: RunId, batch: list[Packed]
    ) -> None:
        """Deliver one batch of packed pieces to the data plane at ``address``; await its
        reply (raising the receiver's error, or :class:`OSError` if the connection failed).

        The message is a small header (each :class:`Packed`'s lists of small integers,
        msgpack-encoded on this loop) and the payloads, whose bytes never pass through Python
        here; the header costs this loop a few hundred nanoseconds per piece, which is why
        transfer tasks pack all of an input chunk's pieces for one worker into one
        :class:`Packed`.
        """
        assert self._pool is not None
        await self._pool.request(address, request_frames(shuffle_id, run_id, batch))


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
