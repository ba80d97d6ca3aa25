"""What a rechunk run does: the frozen, picklable specs that travel between processes.

Where it runs: pure. A :class:`ShuffleSpec` is built on the client and rides in the graph on
the barrier task; the scheduler turns it into a :class:`RunSpec` (adding the run id and the
workers) for every attempt to run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rechunk_p2p.planning import Partial, assign_worker

BARRIER_PREFIX = "rechunk-p2p-barrier-"
TRANSFER_PREFIX = "rechunk-p2p-transfer-"
OUTPUT_PREFIX = "rechunk-p2p-"


def barrier_key(shuffle_id: str) -> str:
    """The key of the barrier task of one sub-shuffle."""
    return BARRIER_PREFIX + shuffle_id


def id_from_key(key: object) -> str | None:
    """The shuffle id of a barrier key, or None for any other key."""
    if isinstance(key, str) and key.startswith(BARRIER_PREFIX):
        return key[len(BARRIER_PREFIX) :]
    return None


@dataclass(frozen=True)
class ShuffleSpec:
    """**Immutable.** One sub-shuffle of a rechunk, independent of any attempt to run it.

    Parameters
    ----------
    id
        Unique id (``<token>-<partial index>``).
    partial
        The partial: its input and output chunks.
    dtype
        The array's dtype.
    storage
        ``"disk"``, ``"memory"`` or ``"auto"`` (read from config on the client).
    output_name
        Name of the output array (the unpack tasks' keys are ``(output_name, *index)``).
    buffer_estimate
        Estimated bytes each worker buffers for this rechunk (used by ``storage="auto"``).
    """

    id: str
    partial: Partial
    dtype: np.dtype
    storage: str
    output_name: str
    buffer_estimate: int

    def output_key(self, flat: int) -> tuple:
        """The key of the unpack task of output ``flat``."""
        return (self.output_name, *self.partial.output_index(flat))


@dataclass(frozen=True)
class RunSpec:
    """**Immutable.** One attempt to run a sub-shuffle: the spec, a run id and its workers.

    Output ``i`` is owned by ``workers[assign_worker(i, n_outputs, len(workers), shift)]``;
    ``dataplanes[k]`` is the data plane address of ``workers[k]``.
    """

    spec: ShuffleSpec
    run_id: int
    workers: tuple[str, ...]
    dataplanes: tuple[str, ...]
    shift: int

    @property
    def id(self) -> str:
        return self.spec.id

    def worker_position(self, flat: int) -> int:
        return assign_worker(flat, self.spec.partial.n_outputs, len(self.workers), self.shift)

    def worker_for(self, flat: int) -> str:
        """The worker that assembles output ``flat``."""
        return self.workers[self.worker_position(flat)]

    def dataplane_for(self, flat: int) -> str:
        """The data plane address of the worker that assembles output ``flat``."""
        return self.dataplanes[self.worker_position(flat)]
