"""The malloc thresholds held while runs are open (rechunk_p2p.worker.allocator), on this
process's own glibc: whether an array is a mapping of its own is read from ``mallinfo2``."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from rechunk_p2p.worker.allocator import (
    GLIBC_DEFAULT_THRESHOLD,
    HELD_TOP_BYTES,
    MAX_MMAP_THRESHOLD,
    MallocTuning,
    load_glibc,
    threshold_from_environment,
)

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
        tuning.hold(0)
        tuning.release()
        tuning.trim_blocking()

    reset()
    yield
    reset()


@needs_glibc
def test_held_thresholds_serve_arrays_below_the_output_size_from_the_heap(worker_thresholds):
    assert _maps_own_pages(1 * MiB)
    tuning = MallocTuning(environ=WORKER_ENV)
    tuning.release()  # not held: changes nothing
    tuning.hold(4 * MiB)
    try:
        assert tuning.held_mmap_threshold == 4 * MiB
        assert not _maps_own_pages(1 * MiB)  # an input chunk, a batch: from the heap
        assert _maps_own_pages(4 * MiB)  # an output chunk: a mapping of its own
    finally:
        assert tuning.release()
    assert tuning.held_mmap_threshold is None
    assert not tuning.release()
    tuning.trim_blocking()  # the top of the heap given back: a new array of a size no
    assert _maps_own_pages(3 * MiB)  # freed block holds is mapped again (128 KiB threshold)


@needs_glibc
def test_smaller_outputs_lower_the_threshold_never_below_the_one_before(worker_thresholds):
    tuning = MallocTuning(environ=WORKER_ENV)
    try:
        tuning.hold(8 * MiB)
        tuning.hold(2 * MiB)
        assert tuning.held_mmap_threshold == 2 * MiB
        tuning.hold(16 * MiB)  # a later run with larger outputs keeps the lower one
        assert tuning.held_mmap_threshold == 2 * MiB
        tuning.hold(1024)  # smaller than the worker's own threshold
        assert tuning.held_mmap_threshold == GLIBC_DEFAULT_THRESHOLD
        tuning.trim_blocking()
        assert _maps_own_pages(5 * MiB)
    finally:
        tuning.release()


@needs_glibc
def test_threshold_is_capped_at_what_glibc_accepts(worker_thresholds):
    tuning = MallocTuning(environ=WORKER_ENV)
    try:
        tuning.hold(1 << 40)
        assert tuning.held_mmap_threshold == MAX_MMAP_THRESHOLD
        assert not _maps_own_pages(16 * MiB)
    finally:
        tuning.release()


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
    tuning.hold(4 * MiB)
    tuning.hold(2 * MiB)
    assert tuning.release()
    tuning.trim_blocking()
    assert libc.calls == [
        ("mallopt", -1, HELD_TOP_BYTES),
        ("mallopt", -3, 4 * MiB),
        ("mallopt", -3, 2 * MiB),
        ("mallopt", -3, 0x40000),
        ("mallopt", -1, 65536),
        ("malloc_trim", 0, 0),
    ]


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
    ],
)
def test_threshold_from_environment(env, name, expected):
    assert threshold_from_environment(env, name) == expected


def test_smallest_output_of_a_run():
    from rechunk_p2p.planning import make_partials
    from rechunk_p2p.spec import ShuffleId, ShuffleSpec
    from rechunk_p2p.worker.plugin import smallest_output

    # float32 (3, 100): rows of two column blocks -> all rows in blocks of 60 and 40 columns
    (partial,) = make_partials(((1, 1, 1), (50, 50)), ((3,), (60, 40)))
    spec = ShuffleSpec(
        shuffle_id=ShuffleId("t-0.0"),
        partial=partial,
        dtype=np.dtype("f4"),
        storage="memory",
        output_name="out",
    )
    assert smallest_output(spec) == 3 * 40 * 4
