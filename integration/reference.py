"""The machine's physical limits for a rechunk, measured in the benchmark's own run.

Where it runs: the benchmark process (a thread for the loopback receiver). Three bandwidths
bound what any rechunk on one machine can do: copying memory (cutting pieces, assembling
outputs), sending bytes over loopback TCP (pieces between worker processes), and writing and
reading the page cache (pieces spilled to local disk). :func:`floor_seconds` turns them into
the time the unavoidable copies and transfers of one rechunk would take.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np

_MiB = 2**20


@dataclass(frozen=True)
class Reference:
    """**Immutable.** Bandwidths in bytes per second (best of a few tries each)."""

    memcpy: float
    loopback: float
    page_cache_write: float
    page_cache_read: float

    def summary(self) -> str:
        gib = 2**30
        return (
            f"memcpy {self.memcpy / gib:.1f} GiB/s, loopback TCP {self.loopback / gib:.1f} GiB/s, "
            f"page cache write {self.page_cache_write / gib:.1f} GiB/s, "
            f"read {self.page_cache_read / gib:.1f} GiB/s"
        )


def measure(directory: str, nbytes: int = 256 * _MiB, tries: int = 3) -> Reference:
    """Measure the three bandwidths with ``nbytes`` per try; ``directory`` holds a scratch file."""
    return Reference(
        memcpy=_best(tries, nbytes, _memcpy_seconds),
        loopback=_best(tries, nbytes, _loopback_seconds),
        page_cache_write=_best(tries, nbytes, lambda n: _page_cache_seconds(directory, n)[0]),
        page_cache_read=_best(tries, nbytes, lambda n: _page_cache_seconds(directory, n)[1]),
    )


def floor_seconds(ref: Reference, nbytes: int, workers: int, disk: bool) -> float:
    """The least time a P2P rechunk of ``nbytes`` on ``workers`` processes of one machine needs.

    Each byte is copied twice (cut, then assembled), the workers copying in parallel; the
    share that belongs to another worker, ``(workers - 1) / workers``, crosses loopback once
    (loopback bandwidth is the machine's, shared by all pairs); with ``disk``, every byte is
    also written to and read back from the page cache, in parallel across workers.

    >>> ref = Reference(memcpy=4e9, loopback=2e9, page_cache_write=2e9, page_cache_read=4e9)
    >>> round(floor_seconds(ref, 2 * 10**9, workers=2, disk=False), 3)
    1.0
    """
    per_worker = nbytes / workers
    seconds = 2 * per_worker / ref.memcpy + nbytes * (workers - 1) / workers / ref.loopback
    if disk:
        seconds += per_worker / ref.page_cache_write + per_worker / ref.page_cache_read
    return seconds


def _best(tries: int, nbytes: int, seconds_for: object) -> float:
    return max(nbytes / seconds_for(nbytes) for _ in range(tries))  # type: ignore[operator]


def _memcpy_seconds(nbytes: int) -> float:
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    dst[:] = src  # fault the pages in first
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def _loopback_seconds(nbytes: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(4 * _MiB)
            while (n := conn.recv_into(buffer)) > 0:
                received[0] += n

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    payload = memoryview(np.ones(4 * _MiB, dtype="u1"))
    with socket.create_connection(server.getsockname()) as conn:
        start = time.perf_counter()
        for _ in range(nbytes // payload.nbytes):
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        thread.join()
        seconds = time.perf_counter() - start
    server.close()
    return seconds


def _page_cache_seconds(directory: str, nbytes: int) -> tuple[float, float]:
    path = os.path.join(directory, "rechunk-bench-reference.bin")
    data = np.ones(nbytes, dtype="u1")
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(memoryview(data))
        written = time.perf_counter() - start
        back = np.empty_like(data)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(back))
        read = time.perf_counter() - start
    finally:
        os.unlink(path)
    return written, read
