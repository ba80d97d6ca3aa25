"""The local execution path: a sub-shuffle computed without distributed workers.

Where it runs: the caller's threads (dask's synchronous or threaded scheduler, as in
``dask.array.utils.assert_eq``); pure numpy, nothing distributed. Each transfer task passes its
input chunk on whole (:class:`LocalInput`), the barrier gathers them (:class:`LocalShuffle`)
and each unpack cuts its output chunk from them with :func:`assemble`, which also builds the
output chunks that need no shuffle at all on any scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rechunk_p2p.errors import RechunkRunError
from rechunk_p2p.spec import ShuffleSpec, widen

Placements = tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]


@dataclass(frozen=True)
class LocalInput:
    """**Immutable.** Input chunk ``flat`` of a sub-shuffle computed without distributed workers."""

    flat: int
    data: Any


@dataclass(frozen=True)
class LocalShuffle:
    """**Immutable.** The input chunks of a sub-shuffle computed without distributed workers.

    ``inputs[i]`` is the input chunk with flat index ``i`` (``None`` for inputs culled away).
    """

    spec: ShuffleSpec
    inputs: tuple[Any, ...]

    def output_blocking(self, flat: int) -> np.ndarray:
        """Cut output chunk ``flat`` from the input chunks."""
        partial, axes = self.spec.partial, self.spec.unknown_axes
        pieces = list(partial.inputs_of_output(flat))
        placements = tuple((widen(i, axes), widen(o, axes)) for _, i, o in pieces)
        data = [self.inputs[partial.flat_input(glob)] for glob, _, _ in pieces]
        return assemble(
            partial.output_shape(flat), self.spec.dtype, placements, *data, unknown=axes
        )


def gather_local(spec: ShuffleSpec | None, parts: tuple[Any, ...]) -> LocalShuffle:
    """The barrier without workers: the transfers' :class:`LocalInput` s of ``spec``."""
    if spec is None or not all(isinstance(p, LocalInput) for p in parts):
        raise RechunkRunError(
            f"The barrier of rechunk {spec.shuffle_id if spec else '?'} got a mix of local "
            "inputs and run ids: compute the whole rechunk either on a distributed cluster or "
            "without one"
        )
    inputs: list[Any] = [None] * spec.partial.n_inputs
    for part in parts:
        inputs[part.flat] = part.data
    return LocalShuffle(spec, tuple(inputs))


def assemble(
    shape: tuple[int, ...],
    dtype: np.dtype,
    placements: Placements,
    *inputs: np.ndarray,
    unknown: tuple[int, ...] = (),
) -> np.ndarray:
    """Build an output chunk directly from its input chunks (no shuffle needed).

    ``placements[i]`` is (slices of input ``i``, slices of the output) for every input.
    Along ``unknown`` axes (unknown chunk sizes) the output takes the inputs' extent.
    """
    if len(inputs) != len(placements):
        raise RechunkRunError(f"Got {len(inputs)} inputs for {len(placements)} placements")
    if unknown and inputs:
        first = np.asarray(inputs[0])
        shape = tuple(first.shape[a] if a in unknown else n for a, n in enumerate(shape))
    if len(inputs) == 1:
        in_slices, _ = placements[0]
        piece = np.asarray(inputs[0])[in_slices]
        if piece.shape == shape:
            return np.array(piece, dtype=dtype, order="C")
    out = np.empty(shape, dtype=dtype)
    for data, (in_slices, out_slices) in zip(inputs, placements):
        out[out_slices] = np.asarray(data)[in_slices]
    return out
