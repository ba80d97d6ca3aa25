"""The data plane under faults: a configured port range, unreachable or silent peers, TLS.

Where it runs: in-process clusters (gen_cluster). A peer is made unreachable by replacing its
advertised data-plane address on the scheduler (the fault injection) with a closed port or with
a socket that accepts connections and never answers.
"""

from __future__ import annotations

import asyncio
import socket
import time

import dask.array as da
import numpy as np
import pytest
from distributed.security import Security
from distributed.utils_test import gen_cluster, gen_test

import rechunk_p2p
from rechunk_p2p.spec import METADATA_KEY
from tests.conftest import assert_clean
from tests.engine_helpers import TWO, check_result

FAST_FAIL = {"rechunk-p2p.comm.timeout": "2s"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@gen_cluster(client=True, nthreads=TWO, config={"rechunk-p2p.dataplane.port": "47100:47140"})
async def test_dataplane_listens_in_the_configured_range(c, s, a, b):
    await rechunk_p2p.register(c)
    addresses = s.get_metadata([METADATA_KEY])
    ports = sorted(int(addr.rsplit(":", 1)[1]) for addr in addresses.values())
    assert len(ports) == 2 and all(47100 <= p <= 47140 for p in ports)
    arr = np.arange(400).reshape(20, 20)
    check_result(await c.compute(rechunk_p2p.rechunk(da.from_array(arr, (1, 20)), (20, 1))), arr)
    await assert_clean(s, a, b)


@gen_cluster(
    client=True, nthreads=[("127.0.0.1", 1)] * 4, config={"rechunk-p2p.dataplane.connections": 1}
)
async def test_a_worker_keeps_at_most_the_configured_connections_open(c, s, *workers):
    """Each worker sends to the three others; with one connection allowed it closes the
    idle one before opening the next (four peers' worth would stay open by default)."""
    await rechunk_p2p.register(c)
    arr = np.arange(64 * 64).reshape(64, 64)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(4, 64)), (64, 4))
    check_result(await c.compute(y), arr)
    for w in workers:
        dataplane = w.plugins["rechunk-p2p"].dataplane
        assert dataplane._pool._limit == 1
        assert dataplane.idle_connections() <= 1
    del y
    await assert_clean(s, *workers)


async def _fails_fast(c, s, a, b, bad_address: str) -> None:
    await rechunk_p2p.register(c)
    s.set_metadata(keys=[METADATA_KEY, b.address], value=bad_address)
    arr = np.arange(40 * 40).reshape(40, 40)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 40)), (40, 1))
    start = time.monotonic()
    with pytest.raises(rechunk_p2p.RechunkCommError, match=bad_address.split("//")[1]) as info:
        await c.compute(y)
    assert time.monotonic() - start < 20  # 2 s deadline per batch, plus scheduling
    assert a.address in str(info.value)  # names the sending worker too
    assert isinstance(info.value, rechunk_p2p.RechunkP2PError)
    del y
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO, config=FAST_FAIL)
async def test_refused_peer_fails_within_the_deadline(c, s, a, b):
    await _fails_fast(c, s, a, b, f"tcp://127.0.0.1:{_closed_port()}")


@gen_cluster(client=True, nthreads=TWO, config=FAST_FAIL)
async def test_silent_peer_fails_within_the_deadline(c, s, a, b):
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        await _fails_fast(c, s, a, b, f"tcp://127.0.0.1:{silent.getsockname()[1]}")
        await asyncio.sleep(0)


@gen_cluster(client=True, nthreads=TWO, security=Security.temporary())
async def test_tls_cluster(c, s, a, b):
    """The data plane uses the workers' TLS settings."""
    await rechunk_p2p.register(c)
    addresses = s.get_metadata([METADATA_KEY])
    assert all(addr.startswith("tls://") for addr in addresses.values())
    arr = np.arange(30 * 30).reshape(30, 30)
    check_result(await c.compute(rechunk_p2p.rechunk(da.from_array(arr, (1, 30)), (30, 1))), arr)
    # rows of 4 KiB: blocks of the input chunks, sent row by row (1 MiB a chunk)
    wide = np.random.default_rng(3).random((256, 4096))
    y = rechunk_p2p.rechunk(da.from_array(wide, (32, 4096)), (256, 512))
    check_result(await c.compute(y), wide)
    await assert_clean(s, a, b)


@gen_cluster(client=True, nthreads=TWO)
async def test_a_barrier_request_whose_connection_broke_is_sent_again(c, s, a, b):
    """A worker's comms aborted under the scheduler's barrier request (distributed's
    test_close_connections does this at random): asked again, not a failed rechunk."""
    from distributed.comm.core import CommClosedError

    await rechunk_p2p.register(c)
    real, broken = s.broadcast, []

    async def breaks_once(**kwargs):
        results = await real(**kwargs)
        if kwargs["msg"].get("op") == "rechunk_p2p_worker_barrier" and not broken:
            broken.append(b.address)  # as if b's connection was aborted mid-request
            results[b.address] = CommClosedError("injected: aborted")
        return results

    s.broadcast = breaks_once
    arr = np.arange(40 * 40).reshape(40, 40)
    y = rechunk_p2p.rechunk(da.from_array(arr, chunks=(1, 40)), (40, 1))
    check_result(await c.compute(y), arr)
    assert broken == [b.address]
    del y
    await assert_clean(s, a, b)


@gen_test()
async def test_requests_to_the_scheduler_are_sent_again_on_a_broken_connection(monkeypatch):
    from types import SimpleNamespace

    from distributed.comm.core import CommClosedError
    from distributed.core import Status

    from rechunk_p2p.worker import scheduler_rpc as plugin

    calls = []

    async def flaky(**kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            raise CommClosedError("injected: aborted")
        return {"status": "OK", "worker": kwargs["worker"]}

    worker = SimpleNamespace(
        scheduler=SimpleNamespace(op=flaky), status=Status.running, address="tcp://w:1"
    )
    reply = await plugin.scheduler_rpc(worker, "op", worker="w")
    assert reply == {"status": "OK", "worker": "w"} and len(calls) == 3
    # it gives up after RPC_RETRY_SECONDS, and at once on a closing worker
    calls.clear()
    monkeypatch.setattr(plugin, "RPC_RETRY_SECONDS", 0.0)
    with pytest.raises(CommClosedError):
        await plugin.scheduler_rpc(worker, "op", worker="w")
    assert len(calls) == 1
    worker.status, calls[:] = Status.closing, []
    monkeypatch.setattr(plugin, "RPC_RETRY_SECONDS", 30.0)
    with pytest.raises(CommClosedError):
        await plugin.scheduler_rpc(worker, "op", worker="w")
    assert len(calls) == 1
