"""Workflows on top of the engine: zarr stores, xarray objects, the command line.

Where it runs: client (the caller's thread). Nothing here runs on an event loop or in a
task. The submodules import zarr and xarray, so they are imported lazily: importing
:mod:`rechunk_p2p` does not import this package's submodules.

The workflows reach the engine through :mod:`rechunk_p2p.arrays` and
:mod:`rechunk_p2p.cluster`; nothing in the engine imports them back, except the public
:mod:`rechunk_p2p.api`, which hands xarray objects to :mod:`.xarray`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def event_loop_probe(client: Any) -> Iterator[Any]:
    """Measure event-loop lag on every server while the block runs.

    Yields the monitor; after the block, ``monitor.report.overall`` has ``p99_ms`` and
    ``max_ms``.
    """
    from rechunk_p2p.diagnostics.loop_monitor import measure_event_loops

    with measure_event_loops(client, interval="5ms") as probe:
        yield probe
