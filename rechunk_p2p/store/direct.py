"""Unbuffered (``O_DIRECT``) reads and writes of the disk store's data file.

Where it runs: task threads, the offload pool and the store I/O pool (a disk store's
background writes, and the extents of one read); blocking, never on the event loop, but
:func:`writeback_threshold_bytes`, read on the worker's loop when a run opens (two small
``/proc`` files).

Why: a spill goes through the page cache twice for nothing. Every spilled byte takes a page
of the cache first (on a virtual machine whose host takes back free memory, a page touched
for the first time in a while costs ~2 s of kernel time per GiB: 6 s of a worker's 22 s of
CPU in the larger-than-memory benchmark went to it), and once the spill outgrows the dirty
limits the writers are held to the disk's speed anyway. With ``O_DIRECT`` the bytes go from
a reused, aligned staging buffer straight to the disk and come back the same way.

The rules of ``O_DIRECT``: the file offset, the length and the memory address of every
read and write are multiples of the device's logical block size (:data:`ALIGNMENT` covers
every common device). So writes are copied into page-aligned staging buffers and padded at
the end (the store starts every write at an aligned offset), and reads fetch the aligned
span around the bytes wanted into a staging buffer, then copy them out. One output's pieces
lie in a few extents of the file (one per flush of the write buffer); the extents are read
in units of up to :data:`UNIT_BYTES`, :data:`READS_IN_FLIGHT` at a time, because one read
at a time leaves most of a disk's bandwidth unused.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import wait

import numpy as np

from rechunk_p2p.offload import OffloadPool

#: Alignment of offsets, lengths and buffers (the largest common logical block size).
ALIGNMENT = 4096
#: Bytes of one staging buffer: a write is copied in and written this much at a time, and
#: a read fetches at most this much before copying it out.
STAGE_BYTES = 8 << 20
#: Largest single read (adjacent extents are read together up to it).
UNIT_BYTES = 1 << 20
#: Ranges closer than this are read together (reading the bytes between them too).
GAP_BYTES = 64 << 10
#: Reads in flight at once for one caller.
READS_IN_FLIGHT = 4

ENDED_EARLY = "the data file ended early (was it truncated or removed?)"

#: ``auto`` uses ``O_DIRECT`` when the pieces a host's workers spill outgrow what the page
#: cache holds before writing back (:func:`writeback_threshold_bytes`), and a store's first
#: write holds at least this many bytes per output on average: below it an output's extents
#: are too small to read from the disk one by one, and the page cache serves them better.
MIN_MEAN_EXTENT = 64 << 10

#: ``place(stage, rows, positions)``: copy rows ``rows`` (indices into the arrays given to
#: :meth:`DirectFile.read_blocking`) out of ``stage``, where row ``rows[k]`` starts at byte
#: ``positions[k]``.
Place = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def aligned_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGNMENT`.

    >>> aligned_up(0), aligned_up(1), aligned_up(4096), aligned_up(4097)
    (0, 4096, 4096, 8192)
    """
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def worth_direct(nbytes: int, outputs: int) -> bool:
    """Whether a first write of ``nbytes`` for ``outputs`` outputs makes extents large
    enough to read back unbuffered.

    >>> worth_direct(32 << 20, 128), worth_direct(32 << 20, 8192)
    (True, False)
    """
    return nbytes >= MIN_MEAN_EXTENT * max(outputs, 1)


def writeback_threshold_bytes() -> int | None:
    """Bytes of dirty page cache past which Linux starts writing back to disk in the
    background (``vm.dirty_background_bytes``, else ``vm.dirty_background_ratio`` percent
    of the memory available); ``None`` where unknown (not Linux). Reads ``/proc`` only
    (no disk): cheap enough for the event loop, once per run."""
    try:
        with open("/proc/sys/vm/dirty_background_bytes") as f:
            nbytes = int(f.read())
        if nbytes:
            return nbytes
        with open("/proc/sys/vm/dirty_background_ratio") as f:
            ratio = int(f.read())
    except (OSError, ValueError):
        return None
    import psutil

    return psutil.virtual_memory().available * ratio // 100


def open_direct(path: str) -> int | None:
    """Open the existing file ``path`` for unbuffered reads and writes; ``None`` where the
    platform has no ``O_DIRECT`` or the file system refuses it (tmpfs on older kernels,
    some network and FUSE file systems)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDWR | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


class DirectFile:
    """**Thread-safe (guarded by `_lock`).** Aligned, unbuffered I/O on one open file.

    ``_lock`` guards the free staging buffers. The descriptor belongs to the caller, who
    closes it after :meth:`close_blocking`.

    Parameters
    ----------
    fd
        A descriptor opened with ``O_DIRECT`` (see :func:`open_direct`).
    pool
        Runs the extents of one read in parallel (the store's I/O pool).
    """

    def __init__(self, fd: int, pool: OffloadPool) -> None:
        self.fd = fd
        self._pool = pool
        self._lock = threading.Lock()
        self._stages: list[mmap.mmap] = []  # free staging buffers, reused
        self._closed = False

    def write_blocking(self, views: Sequence[memoryview], offset: int) -> None:
        """Write the bytes of ``views``, one after another, at the aligned ``offset``; the
        last block is padded (the caller reserved ``aligned_up`` of their size)."""
        assert offset % ALIGNMENT == 0, f"unaligned offset {offset} for an O_DIRECT write"
        stage = self._take_stage()
        try:
            staged = memoryview(stage)
            filled = 0
            for view in views:
                view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                while view.nbytes:
                    n = min(view.nbytes, STAGE_BYTES - filled)
                    staged[filled : filled + n] = view[:n]
                    filled, view = filled + n, view[n:]
                    if filled == STAGE_BYTES:
                        self._write_all(staged, offset)
                        offset, filled = offset + STAGE_BYTES, 0
            if filled:
                self._write_all(staged[: aligned_up(filled)], offset)
            staged.release()
        finally:
            self._give_stage(stage)

    def _write_all(self, block: memoryview, offset: int) -> None:
        while block.nbytes:
            done = os.pwrite(self.fd, block, offset)
            if done <= 0:
                raise OSError(errno.EIO, "the disk accepted no bytes")
            block, offset = block[done:], offset + done

    def read_blocking(self, offsets: np.ndarray, sizes: np.ndarray, place: Place) -> None:
        """Read the byte ranges ``offsets[k]``, ``sizes[k]`` (any order) and hand them to
        ``place``, one staging buffer's worth at a time."""
        keep = np.flatnonzero(sizes > 0)
        order = keep[np.argsort(offsets[keep], kind="stable")]
        units = _units(offsets[order], sizes[order])
        stage = self._take_stage()
        try:
            for window in _windows(units):
                self._read_window(stage, window, order, offsets, place)
        finally:
            self._give_stage(stage)

    def _read_window(
        self,
        stage: mmap.mmap,
        window: list[tuple[int, int, int, int]],
        order: np.ndarray,
        offsets: np.ndarray,
        place: Place,
    ) -> None:
        span = sum(end - base for _, _, base, end in window)
        buffer = stage if span <= STAGE_BYTES else mmap.mmap(-1, span)  # one huge extent
        view = memoryview(buffer)
        reads: list[tuple[memoryview, int, int, int, int]] = []
        try:
            at = 0
            for lo, hi, base, end in window:
                reads.append((view[at : at + end - base], base, at, lo, hi))
                at += end - base
            if len(reads) == 1:
                done = [os.preadv(self.fd, [reads[0][0]], reads[0][1])]
            else:
                pool = self._pool
                futures = [pool.submit(os.preadv, self.fd, [r[0]], r[1]) for r in reads]
                wait(futures)  # all of them, also when one failed: the buffer is reused
                done = [f.result() for f in futures]
            rows = np.concatenate([order[lo:hi] for _, _, _, lo, hi in reads])
            positions = np.concatenate(
                [offsets[order[lo:hi]] - base + at for _, base, at, lo, hi in reads]
            )
            for (target, *_), got in zip(reads, done, strict=True):
                if got < target.nbytes:  # the file is padded: a full span always reads
                    raise OSError(errno.EIO, ENDED_EARLY)
            place(np.frombuffer(buffer, dtype=np.uint8), rows, positions)
        finally:
            del reads  # a larger buffer made for one extent is freed with its views

    def _take_stage(self) -> mmap.mmap:
        with self._lock:
            if self._stages:
                return self._stages.pop()
        return mmap.mmap(-1, STAGE_BYTES)  # page-aligned

    def _give_stage(self, stage: mmap.mmap) -> None:
        # a closed file drops it: freed with its last view (a traceback may hold one)
        with self._lock:
            if not self._closed:
                self._stages.append(stage)

    def close_blocking(self) -> None:
        """Free the staging buffers (no I/O may be in flight)."""
        with self._lock:
            self._closed = True
            self._stages.clear()


def _units(offsets: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Reads for ranges sorted by offset: ``(first, stop, base, end)`` each, covering rows
    ``first:stop`` with the aligned span ``base:end``. Ranges less than :data:`GAP_BYTES`
    apart share a read, up to :data:`UNIT_BYTES`; a range never spans two reads.

    >>> _units(np.array([0, 100, 5000]), np.array([100, 50, 10]))
    [(0, 3, 0, 8192)]
    >>> _units(np.array([0, 2 << 20]), np.array([1 << 20, 10]))
    [(0, 1, 0, 1048576), (1, 2, 2097152, 2101248)]
    """
    units: list[tuple[int, int, int, int]] = []
    ends = offsets + sizes
    gaps = np.flatnonzero(offsets[1:] - ends[:-1] >= GAP_BYTES) + 1
    bounds = [0, *gaps.tolist(), len(offsets)]
    starts, stops = offsets.tolist(), ends.tolist()
    for first, last in itertools.pairwise(bounds):
        while first < last:
            base = starts[first] - starts[first] % ALIGNMENT
            # the rows that end within UNIT_BYTES of base (at least one)
            within = int(np.searchsorted(ends[first:last], base + UNIT_BYTES, side="right"))
            stop = first + max(1, within)
            units.append((first, stop, base, aligned_up(stops[stop - 1])))
            first = stop
    return units


def _windows(
    units: list[tuple[int, int, int, int]],
) -> list[list[tuple[int, int, int, int]]]:
    """``units`` packed, in order, into groups that fit one staging buffer (a unit larger
    than that alone)."""
    windows: list[list[tuple[int, int, int, int]]] = []
    filled = STAGE_BYTES
    for unit in units:
        span = unit[3] - unit[2]
        if filled + span > STAGE_BYTES:
            windows.append([])
            filled = 0
        windows[-1].append(unit)
        filled += span
    return windows
