"""Piece messages on tornado streams: the data plane's framing, connections and listener.

Where it runs: the data plane's event loop (one per worker, see
:mod:`rechunk_p2p.transport.dataplane`).

A request is a fixed prefix (magic, header length, payload length), a msgpack header (the
run, and each batch's :meth:`~rechunk_p2p.transport.wire.Packed.header` and size) and the
payloads' bytes, which the receiver reads straight into one buffer; the reply is a prefix and,
on failure, the pickled exception, raised again at the sender. A connection carries one
request at a time, so a reply always answers the request before it.

Why not distributed's comms, as the data plane used before: per message they walk the message
for its size, run its serializer dispatch for every payload and wrap the call in an RPC, and
per connection they exchange a handshake. On this machine that was about 0.9 ms of CPU a
512 KiB message and 1.3 ms a connection (both ends together), which an all-to-all rechunk
pays ``W x (W - 1)`` times: 2 CPU s of 13 at 32 workers. Streams are tornado's, as
distributed's TCP comms use them, so TLS comes from the workers' own ``Security`` contexts.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import pickle
import socket
import struct
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np
from distributed.comm.addressing import parse_address, parse_host_port
from tornado import netutil
from tornado.iostream import IOStream, SSLIOStream, StreamClosedError
from tornado.tcpclient import TCPClient
from tornado.tcpserver import TCPServer

from rechunk_p2p.spec import RunId, ShuffleId
from rechunk_p2p.transport.receive_buffers import ReceiveBuffers
from rechunk_p2p.transport.wire import Packed, payload_views

logger = logging.getLogger(__name__)

#: ``await handler(shuffle_id, run_id, batch)`` stores a request's pieces (or raises) and
#: returns whether it copied them out, so that nothing refers to their payload any more
Handler = Callable[[ShuffleId, RunId, list[Packed]], Awaitable[bool]]

_MAGIC = b"RP2P"
_REQUEST = struct.Struct("<4sQQ")  # magic, header bytes, payload bytes
_REPLY = struct.Struct("<4sBQ")  # magic, status (0: stored, 1: refused), body bytes
_OK = _REPLY.pack(_MAGIC, 0, 0)

#: Buffers one ``sendmsg`` call takes at most (Linux's ``IOV_MAX``)
_GATHER = 1024

#: Buffers shorter than this go to tornado's buffered writes joined (see :func:`coalesced`)
_SMALL_WRITE = 64 * 1024

#: Incoming bytes a stream may buffer beyond what is being read: none is buffered beyond a
#: message here (payloads are read into their own buffer), so this only has to admit them
_MAX_BUFFER = 2**62


class ProtocolError(ConnectionError):
    """A peer sent something that is not a data-plane message (a stray client, a mismatched
    version): the connection is dropped."""


def request_frames(shuffle_id: ShuffleId, run_id: RunId, batch: list[Packed]) -> list[Any]:
    """The buffers of one request: prefix and header in one, then each payload (no copy)."""
    payloads = [payload_views(p.payload) for p in batch]
    header = msgpack.packb(
        {
            "shuffle_id": shuffle_id,
            "run_id": run_id,
            "headers": [p.header() for p in batch],
            "sizes": [p.nbytes for p in batch],
        },
        use_bin_type=True,
    )
    total = sum(p.nbytes for p in batch)
    views = (v for runs in payloads for v in runs if len(v))
    return [_REQUEST.pack(_MAGIC, len(header), total) + header, *views]


def coalesced(views: list[memoryview], small: int = _SMALL_WRITE) -> list[Any]:
    """``views`` for tornado's buffered writes: each run of consecutive buffers under
    ``small`` bytes joined into one (a copy), the others as they are. A block of an input
    chunk goes as its rows (:func:`~rechunk_p2p.transport.wire.payload_views`), 1 KiB
    each at many workers, and tornado sends each buffer it is given in a system call and a
    pass of its write loop of its own.

    >>> [bytes(v) for v in coalesced([memoryview(b"ab"), memoryview(b"c"), memoryview(b"def")], 3)]
    [b'abc', b'def']
    """
    out: list[Any] = []
    run: list[memoryview] = []
    for view in views:
        if len(view) < small:
            run.append(view)
            continue
        if run:
            out.append(b"".join(run) if len(run) > 1 else run[0])
            run = []
        out.append(view)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


def _is_bytes_view(frame: Any) -> bool:
    return type(frame) is memoryview and frame.ndim == 1 and frame.format == "B"


def send_now(stream: IOStream, frames: list[Any]) -> list[memoryview]:
    """Send what ``stream``'s socket takes of ``frames`` now, in one gathering ``sendmsg``
    (per :data:`_GATHER` buffers), and return the rest (whole frames, or a frame's tail),
    for tornado's buffered writes. A message's payloads are one buffer each (each batch
    views the buffer its input was cut into); tornado's writes send them one system call
    and one pass of its write loop each, a cost per batch where a message at many workers
    holds many small ones. TLS streams, and a stream with writes pending, send nothing here.

    Raises ``OSError`` when the connection failed.
    """
    # (a block's rows are byte views already: one per row, thousands a message)
    views = [f if _is_bytes_view(f) else memoryview(f).cast("B") for f in frames]
    if isinstance(stream, SSLIOStream) or stream.writing() or stream.closed():
        return views
    sock, k = stream.socket, 0
    while k < len(views):
        chunk = views[k : k + _GATHER]
        try:
            sent = sock.sendmsg(chunk)
        except (BlockingIOError, InterruptedError):
            break
        whole = sent == sum(len(v) for v in chunk)
        while sent:
            if sent >= len(views[k]):
                sent -= len(views[k])
                k += 1
            else:
                views[k], sent = views[k][sent:], 0
        if not whole:  # (the socket's buffer is full)
            break
    return views[k:]


async def read_request(
    stream: IOStream, buffers: ReceiveBuffers | None = None
) -> tuple[ShuffleId, RunId, list[Packed], np.ndarray]:
    """The next request on ``stream`` and the buffer its payloads view, read into directly
    (taken from ``buffers`` if given)."""
    prefix = bytearray(_REQUEST.size)
    await stream.read_into(prefix)
    magic, header_bytes, payload_bytes = _REQUEST.unpack(prefix)
    if magic != _MAGIC:
        raise ProtocolError(f"not a rechunk_p2p data-plane message (starts {bytes(prefix[:4])!r})")
    header = bytearray(header_bytes)
    await stream.read_into(header)
    meta = msgpack.unpackb(header, raw=False)
    if payload_bytes and buffers is not None:
        payload = buffers.take(payload_bytes)
    else:
        payload = np.empty(payload_bytes, dtype=np.uint8)
    if payload_bytes:
        # (tornado reads into any writable buffer; its annotation says bytearray)
        await stream.read_into(payload.data)  # type: ignore[arg-type]
    batch, offset = [], 0
    for head, size in zip(meta["headers"], meta["sizes"]):
        batch.append(Packed.from_message(head, payload[offset : offset + size]))
        offset += size
    if offset != payload_bytes:
        raise ProtocolError(f"a message of {payload_bytes} payload bytes described {offset}")
    return meta["shuffle_id"], meta["run_id"], batch, payload


def reply_frame(error: BaseException | None) -> bytes:
    """The reply to a request: stored, or the exception that refused it."""
    if error is None:
        return _OK
    try:
        body = pickle.dumps(error)
    except Exception:  # an exception that does not pickle still reaches the sender
        body = pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
    return _REPLY.pack(_MAGIC, 1, len(body)) + body


async def read_reply(stream: IOStream) -> None:
    """Wait for the reply on ``stream``; raise the receiver's exception if it refused."""
    prefix = bytearray(_REPLY.size)
    await stream.read_into(prefix)
    magic, status, body_bytes = _REPLY.unpack(prefix)
    if magic != _MAGIC:
        raise ProtocolError(f"not a rechunk_p2p data-plane reply (starts {bytes(prefix[:4])!r})")
    if status == 0:
        return
    body = bytearray(body_bytes)
    await stream.read_into(body)
    try:
        error = pickle.loads(body)
    except Exception as e:  # the receiver's exception class is not importable here
        error = RuntimeError(f"the receiving data plane refused the pieces ({e})")
    raise error


def _host_port(address: str) -> tuple[str, int]:
    _, location = parse_address(address)
    host, port = parse_host_port(location)
    return host, int(port)


@functools.lru_cache(maxsize=4096)
def _ip_family(host: str) -> socket.AddressFamily | None:
    """The address family of ``host`` if it is an IP address, else ``None``."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return None
    return socket.AF_INET6 if version == 6 else socket.AF_INET


class StreamPool:
    """**Loop-confined** (the data plane's loop). Outgoing streams, kept per address and
    reused; at most ``limit`` open at once beyond those carrying a request (opening one past
    the limit closes idle ones first).

    Parameters
    ----------
    limit
        Open streams kept at most (each is one file descriptor).
    ssl_context
        The workers' client TLS context, ``None`` for TCP.
    """

    def __init__(self, limit: int, ssl_context: Any = None) -> None:
        self._limit = limit
        self._ssl = ssl_context
        self._client = TCPClient()
        self._idle: dict[str, list[IOStream]] = defaultdict(list)
        self._open: set[IOStream] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        """Streams open and unused (read from any thread: a count, maybe a step behind)."""
        return sum(len(s) for s in list(self._idle.values()))

    async def request(self, address: str, frames: list[Any]) -> None:
        """Send one request to ``address`` and wait for its reply (raising the receiver's
        exception). A stream that failed or was cancelled mid-request is closed, never reused;
        connection failures raise :class:`OSError`."""
        stream = self._take_idle(address) or await self._connect(address)
        try:
            rest = send_now(stream, frames)
            if rest:  # the socket's buffer was full (or TLS): tornado writes the rest
                await asyncio.gather(*map(stream.write, coalesced(rest)))
            await read_reply(stream)
        except BaseException:
            self._discard(stream)
            raise
        if self._closed or len(self._open) > self._limit:  # more went out at once
            self._discard(stream)
        else:
            self._idle[address].append(stream)

    def _take_idle(self, address: str) -> IOStream | None:
        idle = self._idle.get(address)
        while idle:
            stream = idle.pop()
            if not stream.closed():
                return stream
            self._discard(stream)  # the peer closed it (its worker left, say)
        return None

    async def _connect(self, address: str) -> IOStream:
        while len(self._open) >= self._limit and self._close_one_idle():
            pass
        stream = await self._open_stream(address)
        stream.set_nodelay(True)
        self._open.add(stream)
        # also makes tornado watch an idle stream, so one the peer closed leaves the pool
        stream.set_close_callback(functools.partial(self._forget, address, stream))
        if self._closed:  # closed while connecting
            self._discard(stream)
            raise StreamClosedError()
        return stream

    async def _open_stream(self, address: str) -> IOStream:
        """A new stream to ``address``. An IP address is connected to directly: tornado's
        client resolves every host in a thread first (a numeric one too) and races address
        families: a new connection and its first small request cost 0.59 ms of CPU over both
        ends on this machine that way, 0.37 ms this way, paid once per peer, so ``W - 1``
        times by each worker of a run."""
        host, port = _host_port(address)
        family = _ip_family(host)
        if family is None:  # a host name
            return await self._client.connect(
                host, port, ssl_options=self._ssl, max_buffer_size=_MAX_BUFFER
            )
        stream = IOStream(socket.socket(family, socket.SOCK_STREAM), max_buffer_size=_MAX_BUFFER)
        await stream.connect((host, port))  # (closes the socket if it fails)
        if self._ssl is not None:
            stream = await stream.start_tls(False, self._ssl, server_hostname=host)
        return stream

    def _close_one_idle(self) -> bool:
        for address, streams in self._idle.items():
            if streams:
                self._discard(streams.pop(0))
                if not streams:
                    del self._idle[address]
                return True
        return False

    def _discard(self, stream: IOStream) -> None:
        self._open.discard(stream)
        if not stream.closed():
            stream.close()

    def _forget(self, address: str, stream: IOStream) -> None:
        self._open.discard(stream)
        idle = self._idle.get(address)
        if idle and stream in idle:
            idle.remove(stream)

    def close_idle(self) -> None:
        """Close every stream no request uses (the next request opens what it needs)."""
        while self._close_one_idle():
            pass

    def close(self) -> None:
        """Close the idle streams; those carrying a request close when it ends."""
        self._closed = True
        self.close_idle()


class PieceServer(TCPServer):
    """**Loop-confined** (the data plane's loop). Accepts data-plane streams and answers each
    request with ``handler``'s outcome.

    Payloads are read into :attr:`buffers`; a payload whose pieces the handler copied out
    serves a later request.

    Parameters
    ----------
    handler
        ``await handler(shuffle_id, run_id, batch)``: stores the pieces or raises, and
        returns whether it copied them out (see :data:`Handler`).
    ssl_context
        The workers' server TLS context, ``None`` for TCP.
    """

    def __init__(self, handler: Handler, ssl_context: Any = None) -> None:
        super().__init__(ssl_options=ssl_context, max_buffer_size=_MAX_BUFFER)
        self._handler = handler
        self.buffers = ReceiveBuffers()
        self._inbound: set[IOStream] = set()
        self._stopping = False

    def listen_on(self, host: str, port: int, backlog: int) -> int:
        """Listen on ``host:port`` (``0``: any free port) and return the port taken."""
        sockets = netutil.bind_sockets(port, address=host, backlog=backlog)
        self.add_sockets(sockets)
        return sockets[0].getsockname()[1]

    async def handle_stream(self, stream: IOStream, address: Any) -> None:
        if self._stopping:  # accepted as the data plane stopped: no one would close it
            stream.close()
            return
        stream.set_nodelay(True)
        self._inbound.add(stream)
        try:
            while True:
                shuffle_id, run_id, batch, payload = await read_request(stream, self.buffers)
                try:
                    copied = await self._handler(shuffle_id, run_id, batch)
                except Exception as e:
                    await stream.write(reply_frame(e))
                else:
                    del batch  # (views of the payload)
                    if copied and payload.nbytes:
                        self.buffers.give_back(payload)
                    await stream.write(_OK)
        except StreamClosedError:  # the sender closed its stream
            pass
        except Exception as e:  # not our messages, or not whole: drop the stranger
            logger.warning(
                "Data plane dropped a connection from %s: %s: %s", address, type(e).__name__, e
            )
        finally:
            self._inbound.discard(stream)
            stream.close()

    def stop_all(self) -> None:
        """Stop listening and drop every inbound stream (peers may hold theirs open)."""
        self._stopping = True
        self.stop()
        for stream in list(self._inbound):
            stream.close()
