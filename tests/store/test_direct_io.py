"""The disk store's unbuffered (O_DIRECT) file I/O: alignment, windows and fallbacks."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import numpy as np
import pytest

from rechunk_p2p import config, offload
from rechunk_p2p.errors import RechunkInputError, RechunkStorageError
from rechunk_p2p.store import direct
from rechunk_p2p.store import disk_parts as disk_module
from rechunk_p2p.store.disk import DiskPieceStore

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _pieces(sizes: list[int], output: int = 0) -> list[tuple[int, int, np.ndarray]]:
    """One piece per size (in bytes of u1), input k holding the value k + 1."""
    return [(output, k, np.full(n, (k + 1) % 251, np.uint8)) for k, n in enumerate(sizes)]


def _check_round_trip(store: DiskPieceStore, sizes: list[int]) -> None:
    got = store.read_blocking(0)
    assert [i for i, _ in got] == list(range(len(sizes)))
    for k, array in got:
        assert array.nbytes == sizes[k] and (array == (k + 1) % 251).all()


def test_forced_direct_store_writes_aligned_and_bypasses_the_cache(tmp_path):
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "d", direct_io=True)
    store.write_blocking(_pieces([10, 5000]))
    store.write_blocking(_pieces([7], output=1))
    assert store._file.direct is not None
    assert fcntl.fcntl(store._file.direct.fd, fcntl.F_GETFL) & os.O_DIRECT
    # each write starts at an aligned offset: 5010 bytes padded to 8192, then 7 to 4096
    assert store._file.end == 8192 + 4096
    assert os.path.getsize(os.path.join(store.path, disk_module.DATA_FILE)) == 8192 + 4096
    _check_round_trip(store, [10, 5000])
    [(first_input, last)] = store.read_blocking(1)
    assert first_input == 0 and last.tolist() == [1] * 7
    store.close_blocking()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    ("nbytes", "outputs", "unbuffered"),
    [(64 << 10, 1, True), (1 << 20, 16, True), (1 << 20, 17, False), (4096, 4, False)],
)
def test_auto_decides_by_the_first_writes_bytes_per_output(tmp_path, nbytes, outputs, unbuffered):
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "auto")
    each = nbytes // outputs
    store.write_blocking([(o, 0, np.ones(each, np.uint8)) for o in range(outputs)])
    assert (store._file.direct is not None) == unbuffered
    store.write_blocking([(0, 1, np.ones(3, np.uint8))])  # later writes keep the choice
    assert (store._file.direct is not None) == unbuffered
    assert [i for i, _ in store.read_blocking(0)] == [0, 1]
    store.close_blocking()


def test_direct_io_false_never_opens_unbuffered(tmp_path):
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "off", direct_io=False)
    store.write_blocking(_pieces([1 << 20]))
    assert store._file.direct is None
    _check_round_trip(store, [1 << 20])
    store.close_blocking()


def test_a_file_system_refusing_o_direct_falls_back_to_the_cache(monkeypatch, tmp_path):
    opened = []

    def refuse(path):
        opened.append(path)
        return None

    monkeypatch.setattr(disk_module, "open_direct", refuse)
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "refused", direct_io=True)
    store.write_blocking(_pieces([100, 9000]))
    assert len(opened) == 1 and store._file.direct is None
    _check_round_trip(store, [100, 9000])
    store.close_blocking()
    assert not os.listdir(tmp_path)


def test_einval_on_a_direct_write_falls_back_for_good(monkeypatch, tmp_path):
    calls = []

    def refuse(self, views, offset):
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct.DirectFile, "write_blocking", refuse)
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "einval", direct_io=True)
    store.write_blocking(_pieces([100, 9000]))
    store.write_blocking(_pieces([50], output=1))
    assert calls == [0] and store._file.direct is None  # tried once, then buffered
    _check_round_trip(store, [100, 9000])
    store.close_blocking()
    assert not os.listdir(tmp_path)


def test_other_direct_write_errors_are_storage_errors(monkeypatch, tmp_path):
    def full(self, views, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.DirectFile, "write_blocking", full)
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "full", direct_io=True)
    with pytest.raises(RechunkStorageError, match="No space left") as info:
        store.write_blocking(_pieces([10]))
    assert info.value.errno == errno.ENOSPC
    assert store.statistics().pieces == 0
    store.close_blocking()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("buffer_bytes", [0, 3000])
def test_reads_in_small_windows_units_and_huge_extents(monkeypatch, tmp_path, buffer_bytes):
    """With tiny staging buffers and units, one output's pieces (some larger than a staging
    buffer, some far apart, some adjacent) come back whole through every read path."""
    monkeypatch.setattr(direct, "STAGE_BYTES", 16384)
    monkeypatch.setattr(direct, "UNIT_BYTES", 8192)
    monkeypatch.setattr(direct, "GAP_BYTES", 4096)
    rng = np.random.default_rng(7)
    sizes = rng.choice([1, 100, 4095, 4096, 5000, 20000, 70000], size=40).tolist()
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "windows", buffer_bytes, direct_io=True)
    for k, n in enumerate(sizes):  # output 0 interleaved with output 1 (gaps between)
        store.write_blocking([(0, k, np.full(n, (k + 1) % 251, np.uint8))])
        store.write_blocking([(1, k, np.full(3000, 9, np.uint8))])
    _check_round_trip(store, sizes)
    stacked = np.empty(sum(sizes[:10]), np.uint8)
    for k in range(10):
        store.write_blocking([(2, k, np.full(sizes[k], k + 1, np.uint8))])
    assert store.read_stacked_blocking(2, stacked, list(range(10))) == list(range(10))
    assert stacked.tolist() == [k + 1 for k in range(10) for _ in range(sizes[k])]
    into = np.zeros((len(sizes), 3000), np.uint8)
    placement = {k: (k,) for k in range(len(sizes))}
    assert store.read_into_blocking(1, into, placement) == list(range(len(sizes)))
    assert (into == 9).all()
    store.close_blocking()


def test_stacked_read_of_equal_pieces_written_out_of_order(tmp_path):
    """Equal-sized pieces written out of order (several flushes) land in input order."""
    width = 4096
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "equal", 3 * width, direct_io=True)
    inputs = [5, 1, 7, 0, 3, 6, 2, 4]
    for i in inputs:
        store.write_blocking([(0, i, np.full(width, i + 1, np.uint8))])
    out = np.empty(8 * width, np.uint8)
    assert store.read_stacked_blocking(0, out, list(range(8))) == list(range(8))
    assert (out.reshape(8, width) == np.arange(1, 9, dtype=np.uint8)[:, None]).all()
    store.close_blocking()


def test_a_truncated_file_is_a_storage_error_on_direct_read(tmp_path):
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "trunc", direct_io=True)
    store.write_blocking(_pieces([5000]))
    os.truncate(os.path.join(store.path, disk_module.DATA_FILE), 4096)
    with pytest.raises(RechunkStorageError, match="ended early"):
        store.read_blocking(0)
    store.close_blocking()
    assert not os.listdir(tmp_path)


def test_stores_given_a_pool_start_no_threads_of_their_own(tmp_path):
    # background writes and the extents of a read run on the pool a store is given (the
    # worker's): two stores with reads in flight start no thread, and closing them stops none
    pool = offload.OffloadPool(disk_module.STORE_IO_THREADS, "test-store-io")
    before = set(threading.enumerate())

    def started() -> set[threading.Thread]:
        return {t for t in set(threading.enumerate()) - before if t.name[:13] != "test-store-io"}

    stores = [
        DiskPieceStore(np.dtype("u1"), tmp_path, f"s{i}", direct_io=True, io_pool=pool)
        for i in range(2)
    ]
    for store in stores:
        for k in range(6):  # far apart: several reads in flight
            store.write_blocking([(0, k, np.full(200_000, k, np.uint8))])
            store.write_blocking([(1, k, np.ones(200_000, np.uint8))])
    for store in stores:
        pieces = sorted(store.read_blocking(0), key=lambda p: p[0])
        assert [int(a[0]) for _, a in pieces] == list(range(6))
    assert not started()
    assert 2 <= sum(t.name.startswith("test-store-io") for t in threading.enumerate()) <= 6
    for store in stores:
        store.close_blocking()
    assert not started() and not os.listdir(tmp_path)
    pool.shutdown()


def test_a_store_without_a_pool_stops_its_own_at_close(tmp_path):
    store = DiskPieceStore(np.dtype("u1"), tmp_path, "own", direct_io=True)
    for k in range(6):
        store.write_blocking([(0, k, np.ones(200_000, np.uint8))])
        store.write_blocking([(1, k, np.ones(200_000, np.uint8))])
    assert len(store.read_blocking(0)) == 6
    assert any(t.name.startswith("rechunk-p2p-store-io") for t in threading.enumerate())
    store.close_blocking()
    assert not any(t.name.startswith("rechunk-p2p-store-io") for t in threading.enumerate())


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", None), (None, None), (True, True), (False, False), ("false", False)],
)
def test_the_setting(value, expected):
    import dask

    with dask.config.set({"rechunk-p2p.disk-direct-io": value}):
        assert config.direct_io() is expected


def test_a_bad_setting_is_a_clear_error():
    import dask

    expected = "disk-direct-io is 'sometimes'; choose"
    with (
        dask.config.set({"rechunk-p2p.disk-direct-io": "sometimes"}),
        pytest.raises(RechunkInputError, match=expected),
    ):
        config.direct_io()


def test_a_failed_read_waits_for_the_others_before_the_buffer_is_reused(monkeypatch, tmp_path):
    """One of several reads in flight fails: the error is a storage error, raised only once
    the other reads into the same staging buffer have finished."""
    import time

    store = DiskPieceStore(np.dtype("u1"), tmp_path, "fail", direct_io=True)
    for k in range(6):  # output 0's pieces far apart: one read each, several in flight
        store.write_blocking([(0, k, np.ones(200_000, np.uint8))])
        store.write_blocking([(1, k, np.ones(200_000, np.uint8))])
    real, finished = os.preadv, []

    def preadv(fd, buffers, offset):
        if offset == 0:
            raise OSError(errno.EIO, "Input/output error")
        time.sleep(0.05)
        finished.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct.os, "preadv", preadv)
    with pytest.raises(RechunkStorageError, match="Input/output error"):
        store.read_blocking(0)
    assert len(finished) == 5  # every other read of the window was done first
    monkeypatch.setattr(direct.os, "preadv", real)
    store.close_blocking()
    assert not os.listdir(tmp_path)
