"""Reading an output chunk back from a store that keeps pieces: stacked where its inputs
lie one after another in memory, else placed piece by piece, widened along axes of unknown
chunk sizes.

Where it runs: task threads (an output task's assembly), blocking. The stores that keep
pieces (memory, disk) assemble their outputs with it.
"""

from __future__ import annotations

import numpy as np

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.spec import ShuffleSpec, widen
from rechunk_p2p.store.base import KeptPieces, empty_output, place_blocking


def read_output_blocking(
    store: KeptPieces, spec: ShuffleSpec, flat: int
) -> tuple[np.ndarray, list[int]]:
    """Output ``flat`` read from a store that keeps pieces, and the inputs it lacks."""
    partial = spec.partial
    stacked = _stacked_inputs(spec, flat)
    placement = partial.output_placement(flat)
    if stacked is not None:  # the output is its pieces one after another
        out = empty_output(partial.output_shape(flat), spec.dtype)
        received = store.read_stacked_blocking(flat, out, stacked)
        if received == stacked:
            return out, []
    else:
        if spec.unknown_axes:
            out, received = _read_unknown_blocking(store, spec, flat, placement)
        else:
            out = empty_output(partial.output_shape(flat), spec.dtype)
            received = store.read_into_blocking(flat, out, placement)
        if len(received) == len(placement) and set(received) == set(placement):
            return out, []
    extra = sorted(set(received) - set(placement))
    if extra:
        raise RechunkRunError(
            f"Output chunk {partial.output_index(flat)} of rechunk {spec.shuffle_id} got "
            f"pieces from input chunks {[partial.input_index(i) for i in extra][:10]}, "
            "which have no piece of it"
        )
    return out, sorted(set(placement) - set(received))


def _stacked_inputs(spec: ShuffleSpec, flat: int) -> list[int] | None:
    """The inputs of output ``flat`` in memory order, if the store can lay them one after
    another (see :meth:`KeptPieces.read_stacked_blocking`)."""
    if spec.unknown_axes or spec.dtype.hasobject:
        return None
    return spec.partial.stacked_inputs(flat)


def _read_unknown_blocking(
    store: KeptPieces, spec: ShuffleSpec, flat: int, placement: dict[int, tuple[slice, ...]]
) -> tuple[np.ndarray, list[int]]:
    """Output ``flat`` when some axes have unknown chunk sizes: its extent there is the
    pieces' (every piece spans its chunk along those axes)."""
    pieces = store.read_blocking(flat)
    shape = spec.partial.output_shape(flat)
    if pieces:
        like = pieces[0][1].shape
        shape = tuple(like[a] if a in spec.unknown_axes else n for a, n in enumerate(shape))
    out = empty_output(shape, spec.dtype)
    for input_, array in pieces:
        if input_ in placement:
            place_blocking(out, widen(placement[input_], spec.unknown_axes), array)
    return out, [i for i, _ in pieces]
