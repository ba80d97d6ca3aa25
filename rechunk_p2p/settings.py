"""Every ``rechunk-p2p`` setting, read from ``dask.config`` into one validated object a side.

Where it runs: pure. The client reads :class:`ClientSettings` when it builds a graph (they
travel with the graph), the scheduler plugin :class:`SchedulerSettings` for each graph it
receives, and a worker :class:`WorkerSettings` when its plugin starts and again when a run
opens there, so that a setting changed between rechunks applies to the next one. A bad
value fails with one line that names the key (:class:`~rechunk_p2p.errors.RechunkInputError`),
before anything runs. docs/configuration.md says what each key does and why it is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from rechunk_p2p import config
from rechunk_p2p.config import Storage
from rechunk_p2p.errors import RechunkInputError


@dataclass(frozen=True)
class ClientSettings:
    """**Immutable.** The settings that shape a rechunk's graph."""

    storage: Storage
    partial_bytes: int
    transfer_group_bytes: int
    run_buffer_bytes: int | None

    @classmethod
    def read(cls, storage: str | None = None) -> ClientSettings:
        """The current settings, checked; ``storage`` overrides ``rechunk-p2p.storage``.

        Raises
        ------
        RechunkInputError
            A value of the wrong type or out of range (the message names the key).
        """
        config.warn_removed_settings()
        return cls(
            storage=config.storage(storage),
            partial_bytes=_bytes("partial-bytes"),
            transfer_group_bytes=_bytes("transfer-group-bytes"),
            run_buffer_bytes=_optional_bytes("comm.run-buffer-bytes"),
        )


@dataclass(frozen=True)
class SchedulerSettings:
    """**Immutable.** The settings the scheduler plugin reads for each graph."""

    assign_transfers: int
    process_tuning: bool

    @classmethod
    def read(cls) -> SchedulerSettings:
        """The current settings, checked (see :meth:`ClientSettings.read`)."""
        return cls(
            assign_transfers=config.get_count("scheduler.assign-transfers"),
            process_tuning=_flag("process-tuning"),
        )


#: A worker's send buffer is at most this fraction of its memory limit: with the pieces in
#: memory (``storage-memory-fraction``, a quarter) and the disk stores' buffers, the
#: engine's own memory stays under distributed's pause threshold (80 %). 256 MiB, the
#: default, is a quarter of a 1 GiB worker; the most a worker queued in one run of 1 GiB
#: was 18-29 MiB at 8 workers and 42-68 MiB at 16 (512 MiB each, made and held inputs).
SEND_BUFFER_FRACTION = 0.25
#: One run's disk write buffer is at most this fraction of the worker's memory limit (the
#: default 64 MiB from 1 GiB up): three runs of a Dataset spilling at once on a 512 MiB
#: worker buffer 96 MiB
DISK_BUFFER_FRACTION = 1 / 16


@dataclass(frozen=True)
class WorkerSettings:
    """**Immutable.** The settings a worker reads."""

    buffer_bytes: int
    concurrency: int
    ports: range
    connections: int
    message_bytes: int
    timeout: float
    disk_write_buffer_bytes: int
    direct_io: bool | None
    storage_memory_fraction: float
    process_tuning: bool

    @classmethod
    def read(cls) -> WorkerSettings:
        """The current settings, checked (see :meth:`ClientSettings.read`)."""
        return cls(
            buffer_bytes=_positive("comm.buffer-bytes-limit", _bytes("comm.buffer-bytes-limit")),
            concurrency=_positive("comm.concurrency", config.get_count("comm.concurrency")),
            ports=config.port_range("dataplane.port"),
            connections=_positive(
                "dataplane.connections", config.get_count("dataplane.connections")
            ),
            message_bytes=_positive("comm.message-bytes-limit", _bytes("comm.message-bytes-limit")),
            timeout=_positive("comm.timeout", _seconds("comm.timeout")),
            disk_write_buffer_bytes=_bytes("disk-write-buffer-bytes"),
            direct_io=config.direct_io(),
            storage_memory_fraction=_fraction("storage-memory-fraction"),
            process_tuning=_flag("process-tuning"),
        )

    def send_buffer_bytes(self, memory_limit: float | None) -> int:
        """Bytes a worker with ``memory_limit`` queues for sending before transfer tasks
        wait: ``comm.buffer-bytes-limit``, within :data:`SEND_BUFFER_FRACTION` of the limit
        (at least a message)."""
        if not memory_limit:
            return self.buffer_bytes
        bound = max(int(memory_limit * SEND_BUFFER_FRACTION), self.message_bytes)
        return min(self.buffer_bytes, bound)

    def disk_buffer_bytes(self, memory_limit: float | None) -> int:
        """Bytes one run's disk store gathers before it writes, on a worker with
        ``memory_limit``: ``disk-write-buffer-bytes``, within :data:`DISK_BUFFER_FRACTION`
        of the limit."""
        if not memory_limit:
            return self.disk_write_buffer_bytes
        return min(self.disk_write_buffer_bytes, int(memory_limit * DISK_BUFFER_FRACTION))

    def memory_budget(self, memory_limit: float | None) -> float | None:
        """Bytes of pieces ``storage: auto`` keeps in memory on a worker with
        ``memory_limit`` (``storage-memory-fraction`` of it); ``None`` without a limit."""
        return memory_limit * self.storage_memory_fraction if memory_limit else None


def _bytes(key: str) -> int:
    try:
        nbytes = config.get_bytes(key)
    except (TypeError, ValueError) as e:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}: {e}") from None
    if nbytes < 0:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}; give a size >= 0")
    return nbytes


def _optional_bytes(key: str) -> int | None:
    try:
        return config.get_optional_bytes(key)
    except (TypeError, ValueError) as e:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}: {e}") from None


def _seconds(key: str) -> float:
    try:
        return config.get_seconds(key)
    except (TypeError, ValueError, KeyError):
        raise RechunkInputError(
            f"rechunk-p2p.{key} is {config.get(key)!r}; give a duration such as 30s"
        ) from None


N = TypeVar("N", int, float)


def _positive(key: str, value: N) -> N:
    """``value`` of setting ``key``, refused unless above 0."""
    if value <= 0:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}; it must be > 0")
    return value


def _fraction(key: str) -> float:
    value = config.get(key)
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = -1.0
    if isinstance(value, bool) or not 0 < fraction <= 1:
        raise RechunkInputError(f"rechunk-p2p.{key} is {value!r}; give a number in (0, 1]")
    return fraction


def _flag(key: str) -> bool:
    value = config.get(key)
    if not isinstance(value, bool):
        raise RechunkInputError(f"rechunk-p2p.{key} is {value!r}; give true or false")
    return value
