"""Many threads writing, reading and closing at once; the lock is never held during I/O."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.store import make_store

OUTPUTS, INPUTS = 40, 100  # 4,000 distinct pieces


def make_piece(output: int, input_: int) -> tuple[int, int, np.ndarray]:
    shape = (1 + (output * 7 + input_) % 5, 1 + input_ % 3)
    return output, input_, np.full(shape, output * 1000 + input_, dtype="i8")


def test_many_threads_write_then_every_piece_is_read_once(make):
    store = make("i8")
    rng = random.Random(0)
    pieces = [make_piece(o, i) for o in range(OUTPUTS) for i in range(INPUTS)]
    rng.shuffle(pieces)
    batches, start = [], 0
    while start < len(pieces):
        size = rng.randint(1, 40)
        batches.append(pieces[start : start + size])
        start += size
    retries = [rng.sample(b, min(len(b), 3)) for b in rng.sample(batches, 30)]
    with ThreadPoolExecutor(8) as pool:
        accepted = sum(pool.map(store.write_blocking, batches + retries))
    payload = sum(a.nbytes for _, _, a in pieces)
    stats = store.statistics()
    assert accepted == stats.bytes_written == stats.bytes_buffered == payload
    assert stats.pieces == len(pieces)
    assert stats.duplicates == sum(len(r) for r in retries)
    assert stats.outputs == OUTPUTS

    with ThreadPoolExecutor(8) as pool:
        results = dict(
            zip(range(OUTPUTS), pool.map(store.read_blocking, range(OUTPUTS)), strict=True)
        )
    seen = Counter()
    for output, pairs in results.items():
        assert [i for i, _ in pairs] == list(range(INPUTS))
        for input_, array in pairs:
            expected = make_piece(output, input_)[2]
            np.testing.assert_array_equal(array, expected)
            seen[output, input_] += 1
    assert set(seen.values()) == {1} and len(seen) == len(pieces)
    stats = store.statistics()
    assert (stats.bytes_read, stats.bytes_buffered, stats.outputs) == (payload, 0, 0)


def test_reads_interleave_with_writes_and_racing_discards(make):
    store = make("i8")
    store.write_blocking(make_piece(o, i) for o in range(10) for i in range(20))
    got: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def read(output: int) -> None:
        pairs = store.read_blocking(output)
        with lock:
            got.update((output, i) for i, _ in pairs)

    def write(output: int) -> None:
        for i in range(20):
            store.write_blocking([make_piece(output, i)])

    with ThreadPoolExecutor(8) as pool:
        # two racing readers per finished output: exactly one of them gets the data
        futures = [pool.submit(read, o) for o in range(10) for _ in range(2)]
        futures += [pool.submit(write, o) for o in range(10, 20)]
        for future in futures:
            future.result()
    assert got == Counter({(o, i): 1 for o in range(10) for i in range(20)})
    stats = store.statistics()
    assert (stats.pieces, stats.outputs, stats.duplicates) == (400, 10, 0)
    assert all(len(store.read_blocking(o)) == 20 for o in range(10, 20))


def test_close_races_with_writers(make):
    store = make("i8")
    accepted = Counter()
    refused = Counter()

    def writer(t: int) -> None:
        for i in range(100_000):
            try:
                store.write_blocking([make_piece(t, i), make_piece(t, i + 100_000)])
            except RechunkRunError:
                refused[t] += 1
                return
            accepted[t] += 1

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    while store.statistics().pieces < 400:  # close in the middle of the stream
        time.sleep(0.001)
    store.close_blocking()
    for thread in threads:
        thread.join(30)
    assert refused == Counter({t: 1 for t in range(4)})  # every writer saw the close
    stats = store.statistics()
    assert stats.pieces == 2 * sum(accepted.values()) >= 400
    assert (stats.bytes_buffered, stats.outputs) == (0, 0)
    # the fixture asserts that no file or directory is left behind


class BlockedWrites:
    """Make the next ``os.pwritev`` wait until released (to hold a write mid-I/O)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = os.pwritev
        self.entered = threading.Event()
        self.release = threading.Event()
        self.armed = True
        monkeypatch.setattr(os, "pwritev", self)

    def __call__(self, fd, buffers, offset):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(10)
        return self.real(fd, buffers, offset)


def test_disk_lock_is_not_held_during_io(monkeypatch, tmp_path):
    store = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="io")
    store.write_blocking([make_piece(0, 0)])  # the file exists
    blocked = BlockedWrites(monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(store.write_blocking, [make_piece(1, 0)])
        assert blocked.entered.wait(10)
        # while one write is inside pwritev, others write, read and report statistics
        assert store.write_blocking([make_piece(2, 0)]) == 40
        assert store.read_blocking(0)[0][1].tolist() == [[0]]
        assert store.read_blocking(1) == []  # not published before its write completes
        assert store.statistics().pieces == 2
        blocked.release.set()
        assert slow.result(10) == 24
    assert store.read_blocking(1)[0][1].tolist() == [[1000]] * 3
    store.close_blocking()


def test_disk_close_waits_for_writes_in_flight(monkeypatch, tmp_path):
    store = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="wait")
    blocked = BlockedWrites(monkeypatch)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(store.write_blocking, [make_piece(0, 0)])
        assert blocked.entered.wait(10)
        closing = pool.submit(store.close_blocking)
        with pytest.raises(RechunkRunError, match="closed"):
            while True:  # close has begun once new writes are refused
                store.write_blocking([make_piece(5, 5)])
        assert not closing.done()
        assert os.listdir(tmp_path)  # nothing removed under the writer's feet
        blocked.release.set()
        assert slow.result(10) == 8  # make_piece(0, 0) is 1 x 1
        closing.result(10)
    assert not os.listdir(tmp_path)
    store.close_blocking()


def test_disk_stores_sharing_a_missing_parent_come_and_go(tmp_path):
    parent = tmp_path / "rechunk-p2p"  # created and removed by whichever store needs it

    def lifecycle(t: int) -> int:
        for k in range(25):
            store = make_store("disk", dtype=np.dtype("i8"), directory=parent, name=f"s{t}-{k}")
            store.write_blocking([make_piece(t, k)])
            assert store.read_blocking(t)[0][0] == k
            store.close_blocking()
        return t

    with ThreadPoolExecutor(6) as pool:
        assert sorted(pool.map(lifecycle, range(6))) == list(range(6))
    assert not parent.exists() or not os.listdir(parent)
