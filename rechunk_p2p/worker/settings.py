"""The worker side's settings, read from ``dask.config`` into one validated object.

Where it runs: the worker loop (when the plugin starts, and when a run is made); pure.

A bad value fails with one line that names the key. The worker reads its settings when the
plugin starts (the data plane's) and again for each run (the rest), so that a setting
changed on a worker between rechunks applies to the next one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rechunk_p2p import config
from rechunk_p2p.errors import RechunkInputError


@dataclass(frozen=True)
class WorkerSettings:
    """**Immutable.** Every ``rechunk-p2p`` setting a worker reads (see
    docs/configuration.md for each key)."""

    offload_threads: int
    buffer_bytes: int
    concurrency: int
    ports: range
    message_bytes: int
    timeout: float
    disk_write_buffer_bytes: int
    process_tuning: bool

    @classmethod
    def read(cls) -> WorkerSettings:
        """The current settings, checked.

        Raises
        ------
        RechunkInputError
            A value of the wrong type or out of range (the message names the key).
        """
        return cls(
            offload_threads=_positive("offload-threads", config.get_count("offload-threads")),
            buffer_bytes=_positive("comm.buffer-bytes-limit", _bytes("comm.buffer-bytes-limit")),
            concurrency=_positive("comm.concurrency", config.get_count("comm.concurrency")),
            ports=config.port_range("dataplane.port"),
            message_bytes=_positive("comm.message-bytes-limit", _bytes("comm.message-bytes-limit")),
            timeout=_positive("comm.timeout", _seconds("comm.timeout")),
            disk_write_buffer_bytes=_bytes("disk-write-buffer-bytes"),
            process_tuning=_flag("worker.process-tuning"),
        )


def _bytes(key: str) -> int:
    try:
        nbytes = config.get_bytes(key)
    except (TypeError, ValueError) as e:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}: {e}") from None
    if nbytes < 0:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}; give a size >= 0")
    return nbytes


def _seconds(key: str) -> float:
    try:
        return config.get_seconds(key)
    except (TypeError, ValueError, KeyError):
        raise RechunkInputError(
            f"rechunk-p2p.{key} is {config.get(key)!r}; give a duration such as 30s"
        ) from None


def _positive(key: str, value: float) -> int | float:
    if value <= 0:
        raise RechunkInputError(f"rechunk-p2p.{key} is {config.get(key)!r}; it must be > 0")
    return value


def _flag(key: str) -> bool:
    value = config.get(key)
    if not isinstance(value, bool):
        raise RechunkInputError(f"rechunk-p2p.{key} is {value!r}; give true or false")
    return value
