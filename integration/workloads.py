"""Workloads for the integration suite and the benchmark: data made on the workers, checked there.

Where it runs: the client builds graphs here; ``fill_block_blocking`` and
``check_block_blocking`` run in worker task threads. No data ever comes back to the
client except one boolean per output chunk.

Every element's value is a function of its global index (an integer hash below 2**24,
exact in float32 and float64), so each output chunk is checked against the values it
must hold without a reference computation: a misplaced, missing or duplicated element
changes some value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import dask.array as da
import distributed
import numpy as np
from dask.utils import format_bytes, parse_bytes

#: Implementations compared by the benchmark; the suite asserts bounds on the first one.
IMPLEMENTATIONS = ("rechunk_p2p", "dask-p2p", "dask-tasks")

_HASH_MUL = np.uint64(2654435761)
_HASH_ADD = np.uint64(12345)
_HASH_MASK = np.uint64((1 << 24) - 1)
_LOW_32 = np.uint64((1 << 32) - 1)


@dataclass(frozen=True)
class Workload:
    """**Immutable.** One rechunk to run: shape, dtype, chunks before and after.

    Attributes
    ----------
    name
        Short identifier (``"2d-rows-to-cols"``, ...).
    description
        One line for reports.
    shape, dtype
        The array.
    source_chunks, target_chunks
        Block shapes (regular chunking; the last block along an axis may be smaller).
    max_ms
        Bound on the worst loop lag asserted for ``rechunk_p2p``.
    origin
        How the input is had (:data:`ORIGINS`): ``"made"`` inside the rechunk's own tasks
        (generated on the workers), ``"made+map"`` made and then through an elementwise
        step (:func:`mapped`, a scale and offset as CF decoding or a unit change applies),
        ``"held"`` in worker memory before the clock starts (as after ``persist``), or
        ``"derived"`` from held chunks by a reduction over all of them (as anomalies
        are).
    """

    name: str
    description: str
    shape: tuple[int, ...]
    dtype: str
    source_chunks: tuple[int, ...]
    target_chunks: tuple[int, ...]
    max_ms: float = 100.0
    origin: str = "made"

    @property
    def label(self) -> str:
        """The name, and the origin where the input is not made inside the rechunk as it
        is."""
        return self.name if self.origin == "made" else f"{self.name}/{self.origin}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def n_source_chunks(self) -> int:
        return math.prod(
            math.ceil(s / c) for s, c in zip(self.shape, self.source_chunks, strict=True)
        )

    @property
    def n_target_chunks(self) -> int:
        return math.prod(
            math.ceil(s / c) for s, c in zip(self.shape, self.target_chunks, strict=True)
        )

    def summary(self) -> str:
        item = np.dtype(self.dtype).itemsize
        src = format_bytes(math.prod(self.source_chunks) * item)
        dst = format_bytes(math.prod(self.target_chunks) * item)
        return (
            f"{self.label}: {self.dtype} {self.shape} = {format_bytes(self.nbytes)}, "
            f"{self.n_source_chunks} chunks {self.source_chunks} ({src}) -> "
            f"{self.n_target_chunks} chunks {self.target_chunks} ({dst})"
        )


# -- sizes --------------------------------------------------------------------------------

#: How a workload's input is had (see :class:`Workload`).
ORIGINS = ("made", "made+map", "held", "derived")

#: Default bytes per workload (about two minutes for the suite on two busy cores).
DEFAULT_BYTES = {
    "2d": 512 * 2**20,
    "3d": 512 * 2**20,
    "many": 640 * 2**20,
    "2d128": 512 * 2**20,
    "thin1": 512 * 2**20,
    "thin4": 512 * 2**20,
    "thin16": 512 * 2**20,
}


def size_from_env(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Bytes per workload: ``RECHUNK_P2P_BENCH_SIZE`` (e.g. ``1.5GiB``) sets every workload,
    else ``RECHUNK_P2P_BENCH_SCALE`` (a float) multiplies the defaults."""
    env = os.environ if environ is None else environ
    if env.get("RECHUNK_P2P_BENCH_SIZE"):
        n = int(parse_bytes(env["RECHUNK_P2P_BENCH_SIZE"]))
        return dict.fromkeys(DEFAULT_BYTES, n)
    scale = float(env.get("RECHUNK_P2P_BENCH_SCALE", "1") or 1)
    return {k: int(v * scale) for k, v in DEFAULT_BYTES.items()}


def rows_to_columns(nbytes: int) -> Workload:
    """(a) 2-D float64, row blocks -> column blocks (about 16 MiB chunks, at least 8 per axis)."""
    blocks = max(8, round(nbytes / (16 * 2**20)))
    n = max(blocks, round(math.sqrt(nbytes / 8) / blocks) * blocks)
    return Workload(
        "2d-rows-to-cols",
        "2-D float64, row blocks -> column blocks",
        (n, n),
        "float64",
        (n // blocks, n),
        (n, n // blocks),
    )


def rows_to_columns_8mib(nbytes: int) -> Workload:
    """(d) 2-D float64 of 128 row blocks -> 128 column blocks (8 MiB chunks at 1 GiB)."""
    n = max(128, round(math.sqrt(nbytes / 8) / 128) * 128)
    return Workload(
        "2d-128-blocks",
        "2-D float64, 128 row blocks -> 128 column blocks",
        (n, n),
        "float64",
        (n // 128, n),
        (n, n // 128),
    )


def time_to_space(nbytes: int) -> Workload:
    """(b) 3-D float32 (time, y, x): one chunk per step -> full time, 32 x 32 tiles."""
    ny, nx = 512, 512
    nt = max(8, round(nbytes / (4 * ny * nx)))
    return Workload(
        "3d-time-to-space",
        "3-D float32 (time, y, x), one chunk per time step -> full time, small y/x tiles",
        (nt, ny, nx),
        "float32",
        (1, ny, nx),
        (nt, 32, 32),
    )


def many_small(nbytes: int) -> Workload:
    """(c) 2-D float64 in 64 KiB chunks (32 x 256 -> 256 x 32): tens of thousands of chunks."""
    rows = 2048
    cols = max(256, round(nbytes / (8 * rows) / 256) * 256)
    return Workload(
        "many-64KiB-chunks",
        "2-D float64, tens of thousands of 64 KiB chunks, 32 x 256 -> 256 x 32",
        (rows, cols),
        "float64",
        (32, 256),
        (256, 32),
        max_ms=200.0,
    )


def thin_rows(nbytes: int, rows: int) -> Workload:
    """(e) 2-D float64 of 8,192 columns in chunks of ``rows`` rows -> column strips of 4
    columns (all rows): one input chunk's pieces are 32 bytes, four elements of one row."""
    cols = 8192
    n = max(rows * 16, round(nbytes / (8 * cols) / rows) * rows)
    return Workload(
        f"thin-{rows}-rows",
        f"2-D float64, chunks of {rows} rows -> column strips of 4 columns",
        (n, cols),
        "float64",
        (rows, cols),
        (n, 4),
    )


def all_workloads(sizes: dict[str, int] | None = None) -> list[Workload]:
    """The four workloads at the sizes from the environment (or ``sizes``)."""
    sizes = size_from_env() if sizes is None else sizes
    return [
        rows_to_columns(sizes["2d"]),
        time_to_space(sizes["3d"]),
        many_small(sizes["many"]),
        rows_to_columns_8mib(sizes["2d128"]),
    ]


# -- data made and checked on the workers -------------------------------------------------


def expected_block(
    shape: tuple[int, ...], location: list[tuple[int, int]], dtype: str
) -> np.ndarray:
    """The values the block at ``location`` (``[(start, stop), ...]``) of an array holds.

    Element ``i`` (its C-order index in the whole array) holds
    ``(i * _HASH_MUL + _HASH_ADD) mod 2**24``. The hash is linear and 2**24 divides 2**32,
    so it is the sum over axes of ``index_along_axis * stride * _HASH_MUL``, each term and
    the sum taken in wrapping uint32: one small vector per axis, one broadcast add into the
    block, one mask and one cast (about a tenth of evaluating it per element in uint64).
    """
    ndim = len(shape)
    terms = []
    stride = 1
    for axis in reversed(range(ndim)):
        lo, hi = location[axis]
        term = np.arange(lo, hi, dtype=np.uint64) * np.uint64(stride) * _HASH_MUL
        term = (term & _LOW_32).astype(np.uint32)
        terms.append(term.reshape([-1 if a == axis else 1 for a in range(ndim)]))
        stride *= shape[axis]
    *outer, inner = terms[::-1] if ndim else [np.zeros((), np.uint32)]
    base = np.uint32(_HASH_ADD)
    for term in outer:  # the small outer axes first: their sum is tiny
        base = base + term
    block = np.empty([hi - lo for lo, hi in location], dtype=np.uint32)
    np.add(base, inner, out=block)
    block &= np.uint32(_HASH_MASK)
    return block.astype(dtype)


def fill_block_blocking(
    shape: tuple[int, ...], dtype: str, block_info: dict | None = None
) -> np.ndarray:
    """Task body: make one source block."""
    return expected_block(shape, block_info[None]["array-location"], dtype)


def mapped(x: Any) -> Any:
    """The step a ``"made+map"`` input goes through after it is made (a dask array, or a
    block of it when checked: the same operations in the same order give the same bits)."""
    return x * 0.01 + 273.15


def check_block_blocking(
    block: np.ndarray,
    shape: tuple[int, ...],
    dtype: str,
    origin: str = "made",
    block_info: dict | None = None,
) -> np.ndarray:
    """Task body: ``True`` (as a 1-element block) if ``block`` holds exactly its values
    (those of an input of ``origin``)."""
    info = block_info[0]
    want = expected_block(shape, info["array-location"], dtype)
    if origin == "made+map":
        want = mapped(want)
    ok = block.dtype == want.dtype and block.shape == want.shape and np.array_equal(block, want)
    return np.full((1,) * block.ndim, ok)


def source_array(w: Workload) -> da.Array:
    """The workload's input, generated on the workers."""
    chunks = da.core.normalize_chunks(w.source_chunks, w.shape)
    return da.map_blocks(
        fill_block_blocking,
        w.shape,
        w.dtype,
        dtype=w.dtype,
        chunks=chunks,
        name=f"source-{w.name}-{'x'.join(map(str, w.shape))}",
    )


def input_array(w: Workload, client: Any = None) -> da.Array:
    """The workload's input as its origin has it: made inside the rechunk's tasks; held in
    worker memory (persisted on ``client`` here, before any clock starts); or derived from
    held chunks by a reduction over all of them (``x - m + m`` with ``m`` the minimum along
    the first axis: every chunk is computed from its held chunk and from all the others,
    and the values stay exact)."""
    x = source_array(w)
    if w.origin == "made":
        return x
    if w.origin == "made+map":
        return mapped(x)
    if client is None:
        raise ValueError(f"a {w.origin!r} input needs a client to hold it")
    x = client.persist(x)
    distributed.wait(x)
    if w.origin == "held":
        return x
    m = shared_reduction(x)
    return x - m + m


def shared_reduction(x: da.Array) -> da.Array:
    """The reduction every chunk of a derived input reads: the minimum along the first axis
    of the held ``x`` (each implementation computes it before any chunk can be derived)."""
    return x.min(axis=0, keepdims=True)


def checked(y: da.Array, w: Workload) -> da.Array:
    """A 0-d boolean array: every output chunk of ``y`` holds exactly the right values."""
    flags = y.map_blocks(
        check_block_blocking, w.shape, w.dtype, w.origin, dtype=bool, chunks=(1,) * y.ndim
    )
    return flags.all()


# -- implementations ----------------------------------------------------------------------


def rechunk_with(implementation: str, x: da.Array, chunks: tuple[int, ...]) -> da.Array:
    """Rechunk ``x`` with one of :data:`IMPLEMENTATIONS`."""
    if implementation == "rechunk_p2p":
        import rechunk_p2p

        return rechunk_p2p.rechunk(x, chunks)
    if implementation == "dask-p2p":
        return x.rechunk(chunks, method="p2p")
    if implementation == "dask-tasks":
        return x.rechunk(chunks, method="tasks")
    raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")


def workload_graph(
    implementation: str, w: Workload, x: da.Array | None = None
) -> tuple[da.Array, da.Array]:
    """``(rechunked array, its 0-d check)`` for one workload and implementation; ``x``: the
    input (:func:`input_array`; default: made inside the rechunk)."""
    y = rechunk_with(implementation, source_array(w) if x is None else x, w.target_chunks)
    want = da.core.normalize_chunks(w.target_chunks, w.shape)
    if y.chunks != want:
        raise AssertionError(f"{implementation} produced chunks {y.chunks}, expected {want}")
    return y, checked(y, w)
