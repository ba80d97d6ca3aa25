"""The data plane's streams: requests and replies, errors raised at the sender, the limit on
open connections, streams a peer closed, and strangers on the listening port.

Where it runs: one event loop (``gen_test``) holding listeners and pools on localhost.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest
from distributed.utils_test import gen_test
from tornado.iostream import IOStream

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.transport.streams import PieceServer, StreamPool, request_frames, send_now
from rechunk_p2p.transport.wire import Packed, pack_blocking, unpack_blocking


class Receiver:
    """What a listener got, and what it raises for a run id listed in ``refuse``."""

    def __init__(self, refuse: dict[int, BaseException] | None = None) -> None:
        self.got: list[tuple[str, int, list[Packed]]] = []
        self.refuse = refuse or {}

    async def __call__(self, shuffle_id: str, run_id: int, batch: list[Packed]) -> None:
        if run_id in self.refuse:
            raise self.refuse[run_id]
        self.got.append((shuffle_id, run_id, batch))


def listening(receiver: Receiver) -> tuple[PieceServer, str]:
    server = PieceServer(receiver)
    port = server.listen_on("127.0.0.1", 0, backlog=16)
    return server, f"tcp://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def serving(receiver: Receiver) -> AsyncIterator[tuple[PieceServer, str, StreamPool]]:
    """A listener handing requests to ``receiver``, its address, and a pool to send with."""
    server, address = listening(receiver)
    pool = StreamPool(limit=8)
    try:
        yield server, address, pool
    finally:
        pool.close()
        server.stop_all()


def batch_of(dtype: str, seed: int) -> list[Packed]:
    rng = np.random.default_rng(seed)
    pieces = [(o, seed, rng.integers(0, 100, size=(o + 1, 3)).astype(dtype)) for o in range(3)]
    empty = (9, seed, np.zeros((0, 3), dtype=dtype))
    return [pack_blocking(pieces, np.dtype(dtype)), pack_blocking([empty], np.dtype(dtype))]


@gen_test()
async def test_batches_arrive_whole_on_one_reused_connection():
    receiver = Receiver()
    async with serving(receiver) as (server, address, pool):
        sent = {run: batch_of(dtype, run) for run, dtype in enumerate(["f8", "i2", "O"])}
        for run, batch in sent.items():
            await pool.request(address, request_frames("shuffle-x", run, batch))
        assert pool.idle == 1 and len(server._inbound) == 1  # one connection, reused
        assert [(s, r) for s, r, _ in receiver.got] == [("shuffle-x", r) for r in sent]
        for (_, run, got), dtype in zip(receiver.got, ["f8", "i2", "O"]):
            for want, back in zip(sent[run], got):
                assert tuple(back.outputs) == tuple(want.outputs)
                assert back.shapes == want.shapes and back.inputs == want.inputs
                for (o, i, a), (o2, i2, b) in zip(
                    unpack_blocking(want, np.dtype(dtype)), unpack_blocking(back, np.dtype(dtype))
                ):
                    assert (o, i) == (o2, i2)
                    np.testing.assert_array_equal(a, b)


@gen_test()
async def test_a_message_of_many_payloads_arrives_whole():
    # more payloads than one sendmsg takes, more bytes than a socket's buffer holds: part
    # sent gathered, the rest through tornado's buffered writes
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 40_000, size=1_500)
    batch = [
        pack_blocking([(k, k, rng.integers(0, 255, size=int(n)).astype("u1"))], np.dtype("u1"))
        for k, n in enumerate(sizes)
    ]
    receiver = Receiver()
    async with serving(receiver) as (_, address, pool):
        await pool.request(address, request_frames("s", 0, batch))
        await pool.request(address, request_frames("s", 1, batch[:3]))
    ((_, _, got), (_, _, again)) = receiver.got
    assert len(got) == len(batch) and len(again) == 3
    for want, back in zip(batch, got):
        assert back.inputs == want.inputs and bytes(back.payload) == bytes(want.payload)


@gen_test()
async def test_send_now_sends_what_the_socket_takes_and_returns_the_rest_in_order():
    here, there = socket.socketpair()
    stream = IOStream(here)
    try:
        frames = [bytes([k]) * 100_000 for k in range(64)]  # more than the socket's buffer
        whole = b"".join(frames)
        rest = send_now(stream, frames)
        left = sum(len(r) for r in rest)
        assert 0 < left < len(whole)
        assert b"".join(bytes(r) for r in rest) == whole[len(whole) - left :]
        there.setblocking(True)
        got = bytearray()
        while len(got) < len(whole) - left:
            got += there.recv(len(whole) - left - len(got))
        assert bytes(got) == whole[: len(whole) - left]
        writes = [stream.write(r) for r in rest]
        assert stream.writing()  # a write pending: the next frames wait behind it
        assert [bytes(v) for v in send_now(stream, [b"after"])] == [b"after"]

        def receive_rest() -> None:  # (in a thread: the loop writes meanwhile)
            while len(got) < len(whole):
                got.extend(there.recv(len(whole) - len(got)))

        await asyncio.gather(asyncio.to_thread(receive_rest), *writes)
        assert bytes(got) == whole
    finally:
        stream.close()
        there.close()


@gen_test()
async def test_a_refusal_is_raised_at_the_sender_and_the_connection_serves_on():
    refusal = RechunkRunError("pieces of rechunk s (run 1) reached the wrong worker; refused")
    receiver = Receiver(refuse={1: refusal, 2: _Unpicklable("no pickle")})
    async with serving(receiver) as (server, address, pool):
        with pytest.raises(RechunkRunError, match="reached the wrong worker"):
            await pool.request(address, request_frames("s", 1, batch_of("f8", 1)))
        with pytest.raises(RuntimeError, match="_Unpicklable: no pickle"):
            await pool.request(address, request_frames("s", 2, batch_of("f8", 2)))
        await pool.request(address, request_frames("s", 3, batch_of("f8", 3)))
        assert [r for _, r, _ in receiver.got] == [3]
        assert pool.idle == 1 and len(server._inbound) == 1


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this")


@gen_test()
async def test_open_connections_stay_within_the_limit():
    receivers = [Receiver() for _ in range(5)]
    servers = [listening(r) for r in receivers]
    pool = StreamPool(limit=2)
    try:
        for round_ in range(2):
            for _, address in servers:
                await pool.request(address, request_frames("s", round_, batch_of("u1", 0)))
                assert pool.idle <= 2
        assert all(len(r.got) == 2 for r in receivers)
        await asyncio.sleep(0.05)  # the listeners see the closed connections
        assert sum(len(server._inbound) for server, _ in servers) <= 2
        pool.close_idle()
        assert pool.idle == 0
    finally:
        pool.close()
        for server, _ in servers:
            server.stop_all()


@gen_test()
async def test_a_connection_the_peer_closed_is_not_reused():
    receiver = Receiver()
    async with serving(receiver) as (server, address, pool):
        await pool.request(address, request_frames("s", 1, batch_of("f8", 1)))
        for stream in list(server._inbound):
            stream.close()
        for _ in range(100):  # the pool notices the close without sending
            if pool.idle == 0:
                break
            await asyncio.sleep(0.01)
        await pool.request(address, request_frames("s", 2, batch_of("f8", 2)))
        assert [r for _, r, _ in receiver.got] == [1, 2]


@pytest.mark.parametrize(
    "message",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64,  # not a data-plane message
        struct.pack("<4sQQ", b"RP2P", 5, 0) + b"\xc1\xc1\xc1\xc1\xc1",  # a header msgpack refuses
    ],
)
@gen_test()
async def test_a_stranger_is_dropped_and_the_listener_serves_on(message):
    receiver = Receiver()
    async with serving(receiver) as (_, address, pool):
        port = int(address.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        with socket.create_connection(("127.0.0.1", port)) as stranger:
            stranger.setblocking(False)
            await loop.sock_sendall(stranger, message)
            try:  # closed without an answer (reset: it left our bytes unread)
                reply = await asyncio.wait_for(loop.sock_recv(stranger, 100), 5)
            except ConnectionResetError:
                reply = b""
            assert reply == b""
        await pool.request(address, request_frames("s", 1, batch_of("f8", 1)))
        assert [r for _, r, _ in receiver.got] == [1]


@gen_test()
async def test_an_unreachable_peer_raises_oserror():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = StreamPool(limit=8)
    with pytest.raises(OSError):
        await pool.request(f"tcp://127.0.0.1:{port}", request_frames("s", 1, batch_of("f8", 1)))
    assert pool.idle == 0
    pool.close()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
@gen_test()
async def test_a_peer_is_reached_by_host_name_ipv4_and_ipv6(host):
    """IP addresses are connected to directly, host names through tornado's resolver."""
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    receiver = Receiver()
    server = PieceServer(receiver)
    bind = "::1" if host == "::1" else "127.0.0.1"
    try:
        port = server.listen_on(bind, 0, backlog=16)
    except OSError:
        pytest.skip(f"cannot listen on {bind}")
    pool = StreamPool(limit=8)
    if host != "localhost":  # (the resolver's path is not taken)

        async def resolving(*args, **kwargs):
            raise AssertionError("an IP address went through tornado's resolver")

        pool._client.connect = resolving
    address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    try:
        for run in range(2):
            await pool.request(address, request_frames("s", run, batch_of("f8", run)))
        assert [r for _, r, _ in receiver.got] == [0, 1]
        assert pool.idle == 1 and len(server._inbound) == 1
    finally:
        pool.close()
        server.stop_all()


class Copier(Receiver):
    """Copies each batch's pieces out, as the assembling store does, and says so (or not)."""

    def __init__(self, copies: bool) -> None:
        super().__init__()
        self.copies = copies
        self.payloads: list[int] = []  # address of each request's payload

    async def __call__(self, shuffle_id: str, run_id: int, batch: list[Packed]) -> bool:
        base = batch[0].payload.base
        self.payloads.append(base.__array_interface__["data"][0])
        copied = [(o, i, a.copy()) for p in batch for o, i, a in unpack_blocking(p, F8)]
        self.got.append((shuffle_id, run_id, copied))
        return self.copies


F8 = np.dtype("f8")


@pytest.mark.parametrize("copies", [True, False])
@gen_test()
async def test_a_payload_copied_out_is_read_into_again(copies):
    """A handler that copied the pieces out frees their payload's buffer for the next
    request; one that keeps them (views of the payload) keeps it. Each request's pieces
    arrive whole either way."""
    receiver = Copier(copies)
    async with serving(receiver) as (server, address, pool):
        sent = {run: batch_of("f8", run) for run in range(4)}
        for run, batch in sent.items():
            await pool.request(address, request_frames("shuffle-x", run, batch))
        reused = server.buffers.reused
    assert reused == (3 if copies else 0)
    assert (len(set(receiver.payloads)) == 1) == copies
    for _, run, got in receiver.got:
        want = [s for p in sent[run] for s in unpack_blocking(p, F8)]
        assert [(o, i) for o, i, _ in got] == [(o, i) for o, i, _ in want]
        for (_, _, a), (_, _, b) in zip(got, want):
            np.testing.assert_array_equal(a, b)


@gen_test()
async def test_a_refused_payload_is_not_read_into_again():
    """A handler that raised may still be reading its batch (a thread it started): its
    payload's buffer is never lent again."""
    receiver = Receiver(refuse={0: RechunkRunError("refused")})
    async with serving(receiver) as (server, address, pool):
        with pytest.raises(RechunkRunError, match="refused"):
            await pool.request(address, request_frames("shuffle-x", 0, batch_of("f8", 0)))
        await pool.request(address, request_frames("shuffle-x", 1, batch_of("f8", 1)))
        assert server.buffers.reused == 0 and server.buffers.free_bytes == 0
