"""Duplicates, discard, statistics, closing, errors and injected disk faults."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

import numpy as np
import pytest

from rechunk_p2p.errors import (
    RechunkInputError,
    RechunkRunError,
    RechunkStorageError,
    RechunkTypeError,
)
from rechunk_p2p.store import StoreStatistics, make_store
from rechunk_p2p.store import disk as disk_module
from rechunk_p2p.store import files as files_module

from .helpers import assert_same


def piece(output: int, input_: int, n: int = 4) -> tuple[int, int, np.ndarray]:
    return output, input_, np.full(n, 1000 * output + input_, dtype="i8")


# -- duplicates, discard, statistics ---------------------------------------------------------


def test_duplicates_dropped_and_counted(make):
    store = make("i8")
    assert store.write_blocking([piece(0, 0), piece(0, 1), piece(1, 0)]) == 96
    # a retried delivery, plus a duplicate inside one batch: only (2, 0) is new
    retried = [piece(0, 1), piece(2, 0), (2, 0, np.full(4, -1, dtype="i8")), piece(1, 0)]
    assert store.write_blocking(retried) == 32
    stats = store.statistics()
    assert (stats.pieces, stats.duplicates, stats.outputs) == (4, 3, 3)
    assert stats.bytes_written == stats.bytes_buffered == 128
    [(_, got)] = store.read_blocking(2)
    assert got.tolist() == [2000] * 4  # the first copy wins
    assert [i for i, _ in store.read_blocking(0)] == [0, 1]


def test_late_duplicate_after_discard_is_dropped(make):
    store = make("i8")
    store.write_blocking([piece(3, 1)])
    assert len(store.read_blocking(3)) == 1
    assert store.write_blocking([piece(3, 1)]) == 0
    assert store.read_blocking(3) == []
    stats = store.statistics()
    assert (stats.pieces, stats.duplicates, stats.outputs, stats.bytes_buffered) == (1, 1, 0, 0)


def test_reading_discards_the_output(make):
    store = make("i8")
    store.write_blocking([piece(0, 0), piece(0, 1), piece(1, 5)])
    first = store.read_blocking(0)
    assert [i for i, _ in first] == [0, 1]
    stats = store.statistics()
    assert (stats.bytes_read, stats.bytes_buffered, stats.outputs) == (64, 32, 1)
    assert store.read_blocking(0) == []
    assert store.read_blocking(99) == []
    stats = store.statistics()
    assert (stats.bytes_read, stats.bytes_buffered, stats.outputs) == (64, 32, 1)


def test_statistics_snapshot_is_immutable(make, kind):
    store = make("f4")
    assert store.statistics() == StoreStatistics(kind.split("-")[0], 0, 0, 0, 0, 0, 0)
    store.write_blocking([(0, 0, np.zeros(10, "f4"))])
    stats = store.statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.pieces = 5  # type: ignore[misc]
    assert not hasattr(stats, "__dict__")
    in_memory = 0 if kind in ("disk", "disk-direct") else 40  # none, or all (or the buffer)
    spilled = 40 if kind.startswith("disk") else 0
    assert stats == StoreStatistics(kind.split("-")[0], 1, 0, 40, 0, 40, 1, in_memory, spilled)


def test_batch_validated_before_anything_is_stored(make):
    store = make("i8")
    with pytest.raises(RechunkTypeError, match="holds dtype int64"):
        store.write_blocking([piece(0, 0), (0, 1, np.zeros(3, "f8"))])
    with pytest.raises(RechunkTypeError, match="numpy arrays"):
        store.write_blocking([piece(0, 0), (0, 1, [1, 2, 3])])
    with pytest.raises(RechunkTypeError, match="integer indices"):
        store.write_blocking([(0.5, 1, np.zeros(3, "i8"))])
    assert store.statistics() == StoreStatistics(store.statistics().kind, 0, 0, 0, 0, 0, 0)


def test_equivalent_byte_order_is_converted(make):
    store = make("<i4")
    big_endian = np.arange(5, dtype=">i4")
    store.write_blocking([(0, np.int64(0), big_endian)])  # numpy ints are fine as indices
    [(i, got)] = store.read_blocking(np.int32(0))
    assert type(i) is int
    assert got.dtype == np.dtype("<i4")
    assert got.tolist() == [0, 1, 2, 3, 4]


def test_unknown_kind():
    with pytest.raises(RechunkInputError, match="'auto'"):
        make_store("auto", dtype=np.dtype("f8"), directory=None, name="x")  # type: ignore[arg-type]


# -- closing ---------------------------------------------------------------------------------


def test_close_is_idempotent_and_use_after_close_raises(make, kind):
    store = make("i8", name="rechunk-xyz-run-3")
    store.write_blocking([piece(0, 0)])
    store.close_blocking()
    store.close_blocking()
    with pytest.raises(RechunkRunError, match=r"'rechunk-xyz-run-3'.*closed"):
        store.write_blocking([piece(1, 0)])
    with pytest.raises(RechunkRunError, match=r"'rechunk-xyz-run-3'.*closed"):
        store.read_blocking(0)
    stats = store.statistics()
    assert (stats.pieces, stats.bytes_buffered, stats.outputs) == (1, 0, 0)


def test_close_without_writes(make):
    store = make("f8")
    store.close_blocking()
    store.close_blocking()


def test_disk_directory_is_created_lazily_and_removed(tmp_path):
    parent = tmp_path / "worker-dir"
    store = make_store("disk", dtype=np.dtype("i8"), directory=parent, name="rechunk/a b:c")
    assert store.path is None and not parent.exists()
    store.write_blocking([])
    assert not parent.exists()
    store.write_blocking([piece(0, 0)])
    assert store.path == str(parent / "rechunk_a_b_c")
    assert os.listdir(store.path) == [disk_module.DATA_FILE]
    store.close_blocking()
    assert not parent.exists()  # it created `worker-dir`, so it removes it too
    existing = tmp_path / "existing"
    existing.mkdir()
    store = make_store("disk", dtype=np.dtype("i8"), directory=existing, name="s")
    store.write_blocking([piece(0, 0)])
    store.close_blocking()
    assert existing.exists() and not os.listdir(existing)


def test_disk_stores_with_the_same_name_do_not_collide(tmp_path):
    one = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="same")
    two = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="same")
    one.write_blocking([piece(0, 0)])
    two.write_blocking([piece(0, 0, n=7)])
    assert one.path != two.path
    assert os.path.basename(two.path).startswith("same-")
    one.close_blocking()
    [(_, got)] = two.read_blocking(0)
    assert got.shape == (7,)
    two.close_blocking()
    assert not os.listdir(tmp_path)


# -- injected disk faults --------------------------------------------------------------------


def fail_with(code: int):
    def fake(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fake


def test_enospc_raises_actionable_error_and_close_cleans_up(monkeypatch, tmp_path):
    store = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="rechunk-42-run-7")
    store.write_blocking([piece(0, 0)])
    real_pwritev = os.pwritev
    calls = []

    def partial_then_full(fd, buffers, offset):  # one short write lands, then the disk is full
        calls.append(offset)
        if len(calls) == 1:
            return real_pwritev(fd, [buffers[0][:5]], offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", partial_then_full)
    monkeypatch.setattr(os, "pwrite", fail_with(errno.ENOSPC))
    with pytest.raises(RechunkStorageError) as info:
        store.write_blocking([piece(1, 0, n=100), piece(2, 0, n=28)])
    error = info.value
    assert isinstance(error, OSError)
    assert error.errno == errno.ENOSPC
    message = str(error)
    for needle in (
        "rechunk-42-run-7",
        str(tmp_path),
        "1024 bytes",
        "Free space",
        "local",
        "memory",
    ):
        assert needle in message
    assert 'dask.config.set({"rechunk-p2p.storage": "memory"})' in message
    assert len(calls) == 2
    assert os.path.getsize(os.path.join(store.path, disk_module.DATA_FILE)) > 32  # partial data
    stats = store.statistics()
    assert (stats.pieces, stats.bytes_written, stats.outputs) == (1, 32, 1)
    # the failed pieces were not recorded as stored: a retry once space is free succeeds
    monkeypatch.undo()
    assert store.write_blocking([piece(1, 0, n=100)]) == 800
    assert store.read_blocking(1)[0][1].tolist() == [1000] * 100
    store.close_blocking()
    assert not os.listdir(tmp_path)


def test_failure_creating_the_directory_is_a_storage_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    store = make_store("disk", dtype=np.dtype("i8"), directory=blocker, name="s")
    with pytest.raises(RechunkStorageError, match="could not write 32 bytes") as info:
        store.write_blocking([piece(0, 0)])
    assert info.value.errno in (errno.ENOTDIR, errno.EEXIST)
    assert store.statistics().pieces == 0
    store.close_blocking()
    assert os.listdir(tmp_path) == ["not-a-dir"]


def test_truncated_file_is_a_storage_error_on_read(tmp_path):
    store = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="trunc")
    store.write_blocking([piece(0, 0), piece(1, 0)])
    os.truncate(os.path.join(store.path, disk_module.DATA_FILE), 40)
    [(_, ok)] = store.read_blocking(0)
    assert ok.tolist() == [0] * 4
    expected = r"read 32 bytes of output 1.*ended early"
    with pytest.raises(RechunkStorageError, match=expected) as info:
        store.read_blocking(1)
    assert "removed or truncated by something else" in str(info.value)
    assert store.statistics().outputs == 0  # the output was discarded even though it failed
    store.close_blocking()
    assert not os.listdir(tmp_path)


def test_short_writes_and_reads_are_completed(monkeypatch, tmp_path):
    real_pwritev, real_preadv = os.pwritev, os.preadv
    counts = {"w": 0, "r": 0}

    def short_pwritev(fd, buffers, offset):
        counts["w"] += 1
        return real_pwritev(fd, [memoryview(buffers[0])[:7]], offset)

    def short_preadv(fd, buffers, offset):
        counts["r"] += 1
        return real_preadv(fd, [memoryview(buffers[0])[:5]], offset)

    monkeypatch.setattr(os, "pwritev", short_pwritev)
    monkeypatch.setattr(os, "preadv", short_preadv)
    store = make_store("disk", dtype=np.dtype("U3"), directory=tmp_path, name="short")
    arrays = [np.array(["ab", "cde", ""]), np.array("xyz"), np.array([], dtype="U3")]
    store.write_blocking((0, i, a) for i, a in enumerate(arrays))
    got = store.read_blocking(0)
    for (_, array), expected in zip(got, arrays, strict=True):
        assert_same(expected, array)
    # each call moves only part of the first pending buffer: 36 + 12 bytes (the 0-size skipped)
    assert counts == {"w": 6 + 2, "r": 8 + 3}
    store.close_blocking()


def test_batches_larger_than_iov_max(monkeypatch, tmp_path):
    monkeypatch.setattr(files_module, "_IOV_MAX", 4)
    real_preadv = os.preadv
    sizes: list[int] = []

    def counting_preadv(fd, buffers, offset):
        sizes.append(len(buffers))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    store = make_store("disk", dtype=np.dtype("i2"), directory=tmp_path, name="iov")
    # 10 pieces of output 0 are adjacent on disk (a batch is sorted by output): reads coalesce
    store.write_blocking([(o, i, np.full(3, 10 * o + i, "i2")) for i in range(10) for o in (1, 0)])
    got = store.read_blocking(0)
    assert [a.tolist() for _, a in got] == [[i] * 3 for i in range(10)]
    assert sizes == [4, 4, 2]
    store.close_blocking()


def test_failure_to_remove_is_reported_once(monkeypatch, tmp_path):
    store = make_store("disk", dtype=np.dtype("i8"), directory=tmp_path, name="stuck")
    store.write_blocking([piece(0, 0)])
    path = store.path
    monkeypatch.setattr(shutil, "rmtree", fail_with(errno.EACCES))
    with pytest.raises(RechunkStorageError, match="Remove that directory by hand") as info:
        store.close_blocking()
    assert info.value.errno == errno.EACCES and path in str(info.value)
    store.close_blocking()  # idempotent: no second attempt, no second error
    monkeypatch.undo()
    assert os.listdir(path) == [disk_module.DATA_FILE]
    shutil.rmtree(path)


def _gated_pwritev(monkeypatch):
    """``os.pwritev`` held until the returned event is set (a slow disk, injected)."""
    import threading

    gate, entered, real = threading.Event(), threading.Event(), os.pwritev

    def slow(fd, buffers, offset):
        entered.set()
        assert gate.wait(20)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    return gate, entered


def test_writers_go_on_while_half_the_write_buffer_is_written(monkeypatch, tmp_path):
    """Half the buffer goes to a background write; writers fill the other half meanwhile and
    wait only when both are full; every piece is read back."""
    import threading

    store = make_store(
        "disk", dtype=np.dtype("i8"), directory=tmp_path, name="rechunk-1-run-1", buffer_bytes=1600
    )
    gate, entered = _gated_pwritev(monkeypatch)
    store.write_blocking([piece(0, 0, n=100)])  # 800 bytes: half the buffer, handed on
    assert entered.wait(20)  # the background write is in the (held) write
    store.write_blocking([piece(1, 0, n=50)])  # returns although the disk is held
    assert store.statistics().max_bytes_in_memory == 1200
    blocked = threading.Thread(target=store.write_blocking, args=([piece(2, 0, n=100)],))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # both halves full: it waits for the write in flight
    gate.set()
    blocked.join(20)
    assert not blocked.is_alive()
    for output, n in ((0, 100), (1, 50), (2, 100)):
        assert store.read_blocking(output)[0][1].tolist() == [output * 1000] * n
    assert store.statistics().max_bytes_in_memory <= 1600 + 800
    store.close_blocking()
    assert not os.listdir(tmp_path)


def test_a_failed_background_write_is_raised_to_the_next_caller(monkeypatch, tmp_path):
    store = make_store(
        "disk", dtype=np.dtype("i8"), directory=tmp_path, name="rechunk-2-run-1", buffer_bytes=1600
    )
    monkeypatch.setattr(os, "pwritev", fail_with(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", fail_with(errno.ENOSPC))
    store.write_blocking([piece(0, 0, n=100)])  # handed to a background write, which fails
    with pytest.raises(RechunkStorageError, match="Free space") as info:
        store.read_blocking(0)
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(RechunkStorageError):
        store.write_blocking([piece(1, 0, n=10)])
    store.close_blocking()
    assert not os.listdir(tmp_path)
