"""Configuration: the ``rechunk-p2p`` namespace of ``dask.config``.

Where it runs: pure (read anywhere). Defaults live in ``rechunk-p2p.yaml`` beside this
module and are merged into ``dask.config`` on import, without overriding user settings.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from rechunk_p2p.errors import RechunkInputError

_FN = os.path.join(os.path.dirname(__file__), "rechunk-p2p.yaml")

with open(_FN) as f:
    _DEFAULTS: dict[str, Any] = yaml.safe_load(f)

dask.config.update_defaults(_DEFAULTS)

Storage = Literal["disk", "memory", "auto"]
STORAGE_CHOICES: tuple[Storage, ...] = ("disk", "memory", "auto")


def storage(value: str | None = None) -> Storage:
    """``value`` (default: the ``rechunk-p2p.storage`` setting), checked against the choices."""
    chosen = get("storage") if value is None else value
    if chosen not in STORAGE_CHOICES:
        source = "rechunk-p2p.storage" if value is None else "storage"
        raise RechunkInputError(
            f"{source} is {chosen!r}; choose one of {', '.join(STORAGE_CHOICES)}"
        )
    return chosen  # (checked against the choices above)


def direct_io() -> bool | None:
    """The ``rechunk-p2p.disk-direct-io`` setting: ``True``, ``False`` or ``None`` (auto)."""
    value = get("disk-direct-io")
    if value == "auto" or value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise RechunkInputError(
        f"rechunk-p2p.disk-direct-io is {value!r}; choose one of auto, true, false"
    )


#: Settings that are gone, and what replaced them: one warning each when still set
REMOVED = {
    "worker.gil-switch-interval": "process-tuning (the interval is 1 ms while a run is open)",
    "worker.gc-freeze": "process-tuning",
    "worker.malloc-reuse": "process-tuning",
    "worker.output-reuse": "process-tuning",
    "worker.process-tuning": "process-tuning (one setting for workers and the scheduler)",
    "scheduler.process-tuning": "process-tuning (one setting for workers and the scheduler)",
    "offload-threads": "OFFLOAD_THREADS in rechunk_p2p/worker/plugin.py (2 threads, fixed)",
    "comm.retry-count": "comm.timeout (retries back off from 100 ms to 5 s within it)",
    "comm.retry-delay-min": "comm.timeout (retries back off from 100 ms to 5 s within it)",
    "comm.retry-delay-max": "comm.timeout (retries back off from 100 ms to 5 s within it)",
    "partial-outputs": "partial-bytes (a partial holds at most 128 output chunks)",
    "monitor.max-samples": "measure_event_loops(max_samples=...)",
}
_warned: set[str] = set()


def warn_removed_settings() -> None:
    """Warn once (a ``FutureWarning``) for each removed ``rechunk-p2p`` setting still set."""
    for key, instead in REMOVED.items():
        if key in _warned:
            continue
        marker = object()
        if dask.config.get(f"rechunk-p2p.{key}", default=marker) is not marker:
            _warned.add(key)
            warnings.warn(
                f"rechunk-p2p.{key} is no longer a setting and is ignored; see {instead}",
                FutureWarning,
                stacklevel=3,
            )


def get(key: str) -> Any:
    """Return the setting ``rechunk-p2p.<key>``.

    Falls back on the packaged default when the key is missing, for example after a test
    harness replaced ``dask.config.config`` wholesale.
    """
    return dask.config.get(f"rechunk-p2p.{key}", default=_default(key))


def _default(key: str) -> Any:
    node: Any = _DEFAULTS["rechunk-p2p"]
    for part in key.split("."):
        node = node[part]
    return node


def get_bytes(key: str) -> int:
    """Return the setting ``rechunk-p2p.<key>`` as a number of bytes."""
    return int(parse_bytes(get(key)))


def get_optional_bytes(key: str) -> int | None:
    """The setting ``rechunk-p2p.<key>`` as a positive number of bytes, or ``None`` if unset."""
    value = get(key)
    if value is None:
        return None
    nbytes = int(parse_bytes(value))
    if nbytes <= 0:
        raise RechunkInputError(f"rechunk-p2p.{key} is {value!r}; give a positive size or null")
    return nbytes


def get_count(key: str) -> int:
    """The setting ``rechunk-p2p.<key>`` as a whole number, zero or more."""
    value = get(key)
    try:
        count = int(value)
        exact = count == value or str(count) == str(value).strip()
    except (TypeError, ValueError):
        exact = False
    if not exact or count < 0 or isinstance(value, bool):
        raise RechunkInputError(f"rechunk-p2p.{key} is {value!r}; give a whole number, 0 or more")
    return count


def get_seconds(key: str) -> float:
    """Return the setting ``rechunk-p2p.<key>`` as a number of seconds."""
    return float(parse_timedelta(get(key)))


def port_range(key: str) -> range:
    """A port setting: ``0`` (any free port), ``9000``, or ``"9000:9100"`` (first free one).

    >>> port_range_of("9000:9002")
    range(9000, 9003)
    """
    return port_range_of(get(key))


def port_range_of(value: object) -> range:
    """See :func:`port_range`."""
    text = str(value).strip()
    try:
        lo, _, hi = text.partition(":")
        start, stop = int(lo), int(hi or lo)
    except ValueError:
        raise RechunkInputError(
            f"rechunk-p2p.dataplane.port is {value!r}; give a port, 0, or a range like 9000:9100"
        ) from None
    if not 0 <= start <= stop <= 65535:
        raise RechunkInputError(f"rechunk-p2p.dataplane.port {value!r} is not a valid port range")
    return range(start, stop + 1)
