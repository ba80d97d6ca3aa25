"""The piece-store interface: where received pieces wait until their output chunk is built.

Where it runs: offload pool and task threads (blocking; never on the event loop).

In a P2P rechunk every input chunk is cut into pieces, each belonging to one output chunk.
The receiving worker writes pieces into a :class:`PieceStore` from several threads at once
(the offload pool for pieces that arrived over the network, task threads for pieces that
stay on the local worker) and later reads each output chunk's pieces back to assemble it.
Four implementations exist: :class:`~rechunk_p2p.store.assembling.AssemblingMemoryStore`
copies each piece into its output as it comes, :class:`~rechunk_p2p.store.memory.MemoryPieceStore`
keeps the arrays, :class:`~rechunk_p2p.store.disk.DiskPieceStore` spills them to local disk,
and :class:`~rechunk_p2p.store.split.SplitStore` assembles some outputs in memory and spills
the others. All are thread-safe; every method is blocking.
"""

from __future__ import annotations

import mmap
import operator
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from rechunk_p2p.errors import RechunkRunError, RechunkTypeError
from rechunk_p2p.store.allocator import GLIBC_DEFAULT_THRESHOLD
from rechunk_p2p.store.ledger import StoreStatistics
from rechunk_p2p.store.pages import OUTPUT_PAGES
from rechunk_p2p.transport.wire import Piece

if TYPE_CHECKING:
    from rechunk_p2p.spec import ShuffleSpec
    from rechunk_p2p.transport.wire import Packed

__all__ = ["Piece"]  # (defined with the wire format, which stores and senders share)

StoreKind = Literal["disk", "memory", "memory+disk"]
STORE_KINDS: tuple[StoreKind, ...] = ("disk", "memory", "memory+disk")


@runtime_checkable
class PieceStore(Protocol):
    """Where a run's pieces wait for their outputs: what every store does, the run's only
    view of it. Every method is blocking and safe to call from several threads at once.

    Attributes
    ----------
    kind
        What the store is (:data:`STORE_KINDS`).
    copies_pieces
        Whether a write returns with every piece copied into memory or files of the
        store's own, so that nothing refers to the arrays or payloads written any more (a
        receiver then reads its next message into the same buffer).
    fills_outputs
        Whether the store copies every piece into its output as it comes, and so keeps no
        view of a piece (the cutter may then hand it views of buffers it uses again).
    """

    kind: StoreKind
    copies_pieces: bool
    fills_outputs: bool

    def write_blocking(self, pieces: Iterable[Piece]) -> int:
        """Store pieces; return the payload bytes accepted.

        A piece whose ``(output, input)`` pair is already stored (or was stored and then
        read) is dropped and counted as a duplicate, so retried
        deliveries never duplicate data. The batch is validated before anything is stored.

        Raises
        ------
        RechunkRunError
            The store is closed.
        RechunkTypeError
            An array is not a numpy array or has a dtype other than the store's.
        RechunkStorageError
            Spilling to disk failed (disk store only).
        """
        ...

    def write_packed_blocking(self, batch: Iterable[Packed]) -> int:
        """:meth:`write_blocking` for batches of pieces as they came off the wire (or were
        packed for it), without unpacking them where the store can help it."""
        ...

    def assemble_blocking(self, spec: ShuffleSpec, output: int) -> tuple[np.ndarray, list[int]]:
        """Take output chunk ``output`` of the sub-shuffle ``spec``: the array, built from
        its pieces (which the store then forgets), and the inputs whose pieces it lacks,
        sorted (the caller decides what a missing piece means).

        Raises
        ------
        RechunkRunError
            The store is closed, or a piece came from an input that has none of it.
        RechunkStorageError
            Reading the spilled data failed.
        """
        ...

    def spill_blocking(self) -> int:
        """Move the pieces the store holds in memory to local disk, and spill what comes
        from now on, where the store can (the worker is short of memory); the bytes moved
        (0 where it holds none it can move). The caller keeps the store's other users out
        meanwhile."""
        ...

    def forget_outputs_blocking(self, outputs: Iterable[int]) -> None:
        """Forget that ``outputs`` (read already) got their pieces: pieces of them sent anew
        are stored as new ones, and they are assembled again from those."""
        ...

    def close_blocking(self) -> None:
        """Free everything and remove every file and directory the store created.

        Idempotent. Waits for writes and reads in flight in other threads to finish.
        """
        ...

    def statistics(self) -> StoreStatistics:
        """Return a snapshot of the store's counters."""
        ...


class KeptPieces(Protocol):
    """What a store that keeps pieces as they came (memory, disk) gives back of an output,
    for :func:`~rechunk_p2p.store.reading.read_output_blocking` to assemble it."""

    def read_blocking(self, output: int) -> list[tuple[int, np.ndarray]]:
        """Return the ``(input index, array)`` pairs of one output, sorted by input index.

        Arrays have the dtype and shape they were written with and are C-contiguous and
        writeable; ``[]`` if the output has no data. The output's data is freed after reading.

        Raises
        ------
        RechunkRunError
            The store is closed.
        RechunkStorageError
            Reading the spilled data failed (disk store only).
        """
        ...

    def read_into_blocking(
        self, output: int, out: np.ndarray, placement: Mapping[int, tuple[slice, ...]]
    ) -> list[int]:
        """Place every piece of ``output`` into ``out[placement[input]]`` and discard it.

        Returns the input indices of the pieces found (the caller checks completeness).
        """
        ...

    def read_stacked_blocking(self, output: int, out: np.ndarray, order: list[int]) -> list[int]:
        """Fill C-contiguous ``out`` with the pieces of ``output`` one after another, in the
        order of the inputs ``order`` (:meth:`rechunk_p2p.planning.Partial.stacked_inputs`),
        and discard them. Returns the inputs placed, stopping at the first one missing."""
        ...


def closed_error(kind: str, name: str, action: str) -> RechunkRunError:
    """Return the error raised when a closed store is used.

    Where it runs: pure.
    """
    return RechunkRunError(
        f"Cannot {action}: the {kind} piece store {name!r} is closed (its rechunk run has "
        "ended, failed or was restarted)."
    )


def check_piece(piece: Piece, dtype: np.dtype, kind: str, name: str) -> Piece:
    """Validate one piece and return it with plain-int indices and the store's dtype.

    Where it runs: pure. An array whose dtype differs only in byte order notation is
    converted (``casting="equiv"``); any other dtype mismatch raises.

    Raises
    ------
    RechunkTypeError
        The array is not a numpy array, the indices are not integers, or the dtype differs.
    """
    try:
        output, input_, array = piece
        output, input_ = operator.index(output), operator.index(input_)
    except (TypeError, ValueError) as exc:
        raise RechunkTypeError(
            f"The {kind} piece store {name!r} expects (output index, input index, array) "
            f"tuples with integer indices; got {type(piece).__name__}: {exc}"
        ) from exc
    return output, input_, check_array(array, dtype, kind, name, f"output {output}, input {input_}")


def check_array(array: Any, dtype: np.dtype, kind: str, name: str, of: str) -> np.ndarray:
    """:func:`check_piece`'s check of the array alone (``of`` names it in errors): a numpy
    array of ``dtype``, converted from another byte order notation."""
    if not isinstance(array, np.ndarray):
        raise RechunkTypeError(
            f"The {kind} piece store {name!r} expects numpy arrays; got "
            f"{type(array).__name__} for {of}."
        )
    if array.dtype != dtype:
        if not np.can_cast(array.dtype, dtype, casting="equiv"):
            raise RechunkTypeError(
                f"The {kind} piece store {name!r} holds dtype {dtype}; got a piece of dtype "
                f"{array.dtype} for {of}."
            )
        array = array.astype(dtype, casting="equiv")
    return array


def owned_array(array: np.ndarray) -> np.ndarray:
    """Return ``array`` if it is C-contiguous and writeable, else a C-ordered copy.

    Where it runs: pure. Keeps 0-d arrays 0-d (unlike ``np.ascontiguousarray``).
    """
    if array.flags.c_contiguous and array.flags.writeable:
        return array
    return np.array(array, order="C", copy=True)


SMALL_COPY_BYTES = 256 * 2**10
"""Pieces up to this size are placed with the GIL held (see :func:`place_blocking`)."""


_PAGE = mmap.PAGESIZE
#: Output chunks of at least this many bytes get pages of their own (glibc's default mmap
#: threshold, which distributed's workers keep: see rechunk_p2p.store.allocator)
OWN_PAGES_BYTES = GLIBC_DEFAULT_THRESHOLD


def empty_output(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new C-contiguous array for an output chunk.

    Where it runs: task threads and the offload pool. An output outlives its run, and while
    runs are open malloc keeps freed memory for the next arrays (see
    :mod:`rechunk_p2p.store.allocator`); an output of :data:`OWN_PAGES_BYTES` or more is
    therefore a private anonymous mapping of its own, unmapped when the array is freed, as
    malloc does for such arrays in a worker otherwise; while runs are open, the mapping of
    an output freed on the worker serves the next output of its size
    (:mod:`rechunk_p2p.store.pages`). No huge pages are advised (numpy advises them for
    its own arrays from 4 MiB on): with outputs so advised, the workers spent 2-3 times the
    kernel time on the benchmark's workloads, on a VM (why is not known: the kernel did not
    stall to compact memory; the git history of docs/performance.md has the runs).
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize < OWN_PAGES_BYTES or dtype.hasobject:
        return np.empty(shape, dtype=dtype)
    return OUTPUT_PAGES.take_blocking(count * dtype.itemsize).view(dtype).reshape(shape)


def touch_pages_blocking(array: np.ndarray) -> None:
    """Write one byte of every memory page of a new C-contiguous ``array``, the GIL
    released (numpy releases it for a fill of more than a few hundred elements).

    Where it runs: task threads and the offload pool. A new array's pages are mapped on
    first write, and a first write inside a copy that holds the GIL (a small piece's
    memory move, see :func:`place_blocking`) holds it through the page faults too: on
    virtual machines a fault costs microseconds, and filling a fresh output from many
    pieces that way stalls the event loops for milliseconds at a time. Touching the pages
    first moves the faults out of the GIL.
    """
    if array.nbytes >= 16 * _PAGE and array.flags.c_contiguous:
        array.reshape(-1).view(np.uint8)[::_PAGE] = 0


def place_blocking(out: np.ndarray, where: tuple[slice, ...], piece: np.ndarray) -> None:
    """Copy ``piece`` into ``out[where]``.

    Where it runs: task threads and the offload pool. numpy releases the GIL for every copy of
    more than a few hundred elements and must take it back afterwards; with other threads
    wanting the GIL (the event loops, the data plane), each small copy then waits for a switch
    interval instead of the microsecond it needs, and assembling an output from a thousand
    4 KiB pieces takes a hundred times longer. A small piece whose destination is one
    contiguous run of ``out`` (the usual case: a piece spans the output's trailing axes) is
    therefore copied as a single memory move with the GIL held; anything else is a numpy
    assignment.
    """
    at: tuple[Any, ...] = (*where, Ellipsis)
    copy_into_blocking(out[at], piece)  # a view, also of a 0-d array


def copy_into_blocking(region: np.ndarray, piece: np.ndarray) -> None:
    """Copy ``piece`` into ``region``, a view of the same shape: a small contiguous copy as
    one memory move with the GIL held (see :func:`place_blocking`), anything else as a numpy
    assignment, which lets other threads run during a large copy."""
    if (
        piece.nbytes <= SMALL_COPY_BYTES
        and region.flags.c_contiguous
        and piece.flags.c_contiguous
        and region.shape == piece.shape
        and region.dtype == piece.dtype
        and not region.dtype.hasobject
        and region.nbytes
    ):
        # a memoryview slice assignment is a memcpy that keeps the GIL
        region.reshape(-1).view(np.uint8).data[:] = piece.reshape(-1).view(np.uint8).data
    else:
        region[...] = piece
