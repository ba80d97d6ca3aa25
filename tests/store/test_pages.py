"""Pages of freed outputs kept for the next outputs (rechunk_p2p.store.pages)."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from rechunk_p2p.store import pages as pages_module
from rechunk_p2p.store.base import OWN_PAGES_BYTES, empty_output
from rechunk_p2p.store.pages import OutputPages

MiB = 2**20


def _mapped(address: int) -> bool:
    """Whether ``address`` is inside one of this process's mappings."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def _open_pool(limit: int = 64 * MiB) -> OutputPages:
    pool = OutputPages(limit)
    pool.open()
    return pool


def test_a_freed_mapping_serves_the_next_output_of_its_size():
    pool = _open_pool()
    first = pool.take_blocking(MiB)
    assert first.dtype == np.uint8 and first.shape == (MiB,)
    assert first.flags.c_contiguous and first.flags.writeable
    address = first.ctypes.data
    first[:] = 7
    del first
    assert pool.held_bytes == MiB
    second = pool.take_blocking(MiB)
    assert second.ctypes.data == address and (pool.reused, pool.mapped) == (1, 1)
    assert pool.held_bytes == 0
    other = pool.take_blocking(2 * MiB)  # another size: a new mapping
    assert other.ctypes.data != address and (pool.reused, pool.mapped) == (1, 2)


def test_views_keep_the_mapping_until_the_last_is_gone():
    pool = _open_pool()
    out = pool.take_blocking(MiB).view(np.float32).reshape(512, 512)
    out[...] = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    column = out[:, 3]
    del out
    gc.collect()
    assert pool.held_bytes == 0  # the column still views it
    np.testing.assert_array_equal(column, np.arange(3, 512 * 512, 512, dtype=np.float32))
    new = pool.take_blocking(MiB)
    new[:] = 0
    assert column[1] == 515  # not handed out again while viewed
    del column
    assert pool.held_bytes == MiB


def test_a_closed_pool_unmaps_what_is_freed():
    pool = OutputPages()
    out = pool.take_blocking(MiB)
    address = out.ctypes.data
    del out
    assert pool.held_bytes == 0 and not _mapped(address)


def test_the_last_close_unmaps_what_was_kept():
    pool = _open_pool()
    pool.open()  # a second run
    arrays = [pool.take_blocking(MiB) for _ in range(3)]
    addresses = [a.ctypes.data for a in arrays]
    del arrays
    assert pool.held_bytes == 3 * MiB
    assert pool.close() is None  # another run is open: kept
    assert pool.held_bytes == 3 * MiB
    unmap = pool.close()
    assert unmap is not None and pool.held_bytes == 0
    assert all(_mapped(a) for a in addresses)  # the unmapping is the caller's, in a thread
    unmap()
    assert not any(_mapped(a) for a in addresses)
    assert pool.close() is None  # nothing kept, nothing to do


def test_what_is_kept_stays_within_the_limit():
    pool = _open_pool(limit=3 * MiB)
    small = [pool.take_blocking(MiB) for _ in range(4)]
    addresses = [a.ctypes.data for a in small]
    del small
    assert pool.held_bytes == 3 * MiB  # the fourth did not fit
    assert sum(_mapped(a) for a in addresses) == 3
    big = pool.take_blocking(2 * MiB)
    address = big.ctypes.data
    del big
    assert pool.held_bytes == 3 * MiB and not _mapped(address)  # no room left: unmapped
    pool.close()()
    pool.open()
    larger = pool.take_blocking(4 * MiB)  # larger than the limit: never kept
    address = larger.ctypes.data
    del larger
    assert pool.held_bytes == 0 and not _mapped(address)


def test_empty_output_uses_the_worker_pool(monkeypatch):
    pool = _open_pool()
    monkeypatch.setattr(pages_module, "OUTPUT_PAGES", pool)
    monkeypatch.setattr("rechunk_p2p.store.base.OUTPUT_PAGES", pool)
    shape = (64, 64, 64)
    out = empty_output(shape, np.dtype("f8"))
    assert out.shape == shape and out.dtype == np.float64 and out.flags.c_contiguous
    address = out.ctypes.data
    del out
    again = empty_output(shape, np.dtype("f8"))
    assert again.ctypes.data == address and pool.reused == 1
    small = empty_output((10,), np.dtype("f8"))  # below OWN_PAGES_BYTES: from malloc
    assert small.nbytes < OWN_PAGES_BYTES and pool.mapped == 1


def test_threads_take_and_free_concurrently():
    pool = _open_pool(limit=4 * MiB)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            for _ in range(200):
                out = pool.take_blocking(MiB // 4)
                out[:] = seed
                time.sleep(0)  # let the other threads write theirs
                assert (out == seed).all()  # nobody else was handed these pages
                del out
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.reused + pool.mapped == 800 and pool.reused > 0
    assert pool.held_bytes <= 4 * MiB


@pytest.mark.parametrize("dtype", ["f4", "i8", "c16"])
def test_reused_pages_hold_the_previous_output_until_written(dtype):
    """A kept mapping is handed out as it is (no zeroing): every reader of empty_output
    writes the whole output, which the engine tests check with stale pages in the pool."""
    pool = _open_pool()
    out = pool.take_blocking(MiB)
    out[:] = 0xAB
    del out
    again = pool.take_blocking(MiB).view(dtype)
    assert (again.view(np.uint8) == 0xAB).all()
