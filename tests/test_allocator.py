"""The malloc thresholds held while runs are open (rechunk_p2p.store.allocator), on this
process's own glibc: whether an array is a mapping of its own is read from ``mallinfo2``."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rechunk_p2p.store.allocator import (
    GLIBC_DEFAULT_THRESHOLD,
    HELD_TOP_BYTES,
    MAX_MMAP_THRESHOLD,
    MallocTuning,
    load_glibc,
    threshold_from_environment,
)
from rechunk_p2p.store.base import OWN_PAGES_BYTES, empty_output

MiB = 2**20
LIBC = load_glibc()
needs_glibc = pytest.mark.skipif(
    LIBC is None or not hasattr(LIBC, "mallinfo2"), reason="needs glibc >= 2.33"
)
#: distributed's worker environment (MALLOC_TRIM_THRESHOLD_) with the mmap default spelled out
WORKER_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_MMAP_THRESHOLD_": "131072"}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mapped_bytes() -> int:
    """Bytes of this process's allocations that are mappings of their own."""
    LIBC.mallinfo2.restype = _MallInfo2
    return LIBC.mallinfo2().hblkhd


def _maps_own_pages(nbytes: int) -> bool:
    """Whether a new array of ``nbytes`` is a mapping of its own."""
    before = _mapped_bytes()
    array = np.empty(nbytes, dtype=np.uint8)
    mapped = _mapped_bytes() - before >= nbytes
    del array
    return mapped


@pytest.fixture
def worker_thresholds():
    """This process's malloc as in a worker distributed started (fixed thresholds), with
    the free memory at the top of its heaps given back, before and after the test."""

    def reset() -> None:
        tuning = MallocTuning(environ=WORKER_ENV)
        tuning.hold()
        tuning.release()
        tuning.trim_blocking()

    reset()
    yield
    reset()


#: Run in a fresh process started as distributed starts a worker (MALLOC_TRIM_THRESHOLD_ set):
#: in the test process, free chunks left in the heap by earlier tests would serve some
#: arrays whatever the thresholds (malloc maps memory only when no free chunk fits).
_HEAP_SCRIPT = """
import json
import numpy as np
from tests.test_allocator import _maps_own_pages, MiB
from rechunk_p2p.store.allocator import MAX_MMAP_THRESHOLD, MallocTuning

seen = {"before": _maps_own_pages(1 * MiB)}
tuning = MallocTuning()
seen["release unheld"] = tuning.release()
tuning.hold()
seen["held"] = tuning.held
seen["held 1 MiB"] = _maps_own_pages(1 * MiB)
seen["held 16 MiB"] = _maps_own_pages(16 * MiB)
seen["held 33 MiB"] = _maps_own_pages(MAX_MMAP_THRESHOLD + MiB)
seen["release"] = tuning.release()
tuning.trim_blocking()
# larger than the free chunks the held arrays left (1 and 16 MiB): the threshold decides
seen["after 20 MiB"] = _maps_own_pages(20 * MiB)
print(json.dumps(seen))
"""


@needs_glibc
def test_held_thresholds_serve_arrays_up_to_32_mib_from_the_heap():
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", _HEAP_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "before": True,  # the worker's fixed 128 KiB threshold: a mapping of its own
        "release unheld": False,
        "held": True,
        "held 1 MiB": False,  # an input chunk, a batch: from the heap
        "held 16 MiB": False,
        "held 33 MiB": True,  # past the 32 MiB glibc accepts
        "release": True,
        "after 20 MiB": True,  # the threshold before, again
    }


def _mapping_of(address: int) -> tuple[int, int] | None:
    """The ``(start, end)`` of this process's mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


@needs_glibc
@pytest.mark.parametrize("shape", [(1024, 32, 32), (300, 181), (3, 100)])
def test_outputs_of_128_kib_or_more_are_mappings_of_their_own(worker_thresholds, shape):
    tuning = MallocTuning(environ=WORKER_ENV)
    tuning.hold()  # as in a worker with a run open: malloc would serve them from the heap
    try:
        out = empty_output(shape, np.dtype("f4"))
        assert out.shape == shape and out.dtype == np.float32
        assert out.flags.c_contiguous and out.flags.writeable
        out[...] = 7
        address = out.ctypes.data
        if out.nbytes < OWN_PAGES_BYTES:
            assert out.base is None
            return
        assert _mapping_of(address) is not None
        del out
        assert _mapping_of(address) is None  # unmapped when freed: back to the system
    finally:
        tuning.release()


def test_empty_output_of_object_dtype():
    out = empty_output((100_000,), np.dtype(object))
    assert out.dtype == object and out.base is None


class _RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad, 0))
        return 1


def test_release_sets_the_thresholds_read_from_the_environment():
    libc = _RecordingLibc()
    env = {
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=0x40000",
        "MALLOC_TRIM_THRESHOLD_": "65536",
    }
    tuning = MallocTuning(libc=libc, environ=env)  # type: ignore[arg-type]
    tuning.hold()
    tuning.hold()  # held already
    assert tuning.release()
    tuning.trim_blocking()
    assert libc.calls == [
        ("mallopt", -1, HELD_TOP_BYTES),
        ("mallopt", -3, MAX_MMAP_THRESHOLD),
        ("mallopt", -3, 0x40000),
        ("mallopt", -1, 65536),
        ("malloc_trim", 0, 0),
    ]


def test_higher_thresholds_before_stay():
    libc = _RecordingLibc()
    env = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(2**30)}
    tuning = MallocTuning(libc=libc, environ=env)  # type: ignore[arg-type]
    tuning.hold()
    assert libc.calls == [("mallopt", -1, 2**30), ("mallopt", -3, 2**30)]


@pytest.mark.parametrize(
    ("env", "name", "expected"),
    [
        ({}, "trim_threshold", GLIBC_DEFAULT_THRESHOLD),
        ({"MALLOC_TRIM_THRESHOLD_": "65536"}, "trim_threshold", 65536),
        ({"MALLOC_MMAP_THRESHOLD_": "0x100000"}, "mmap_threshold", 2**20),
        (
            {"MALLOC_MMAP_THRESHOLD_": "1", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=2"},
            "mmap_threshold",
            2,
        ),
        ({"MALLOC_TRIM_THRESHOLD_": "lots"}, "trim_threshold", GLIBC_DEFAULT_THRESHOLD),
        ({"MALLOC_TRIM_THRESHOLD_": str(2**40)}, "trim_threshold", 2**31 - 1),  # a C int
        ({"MALLOC_TRIM_THRESHOLD_": "-5"}, "trim_threshold", 0),
    ],
)
def test_threshold_from_environment(env, name, expected):
    assert threshold_from_environment(env, name) == expected
