"""``rechunk_p2p.performance_report``: the engine's dashboard page and run report, saved to
one HTML file for the rechunks of a block of code.

Where it runs: the client (entering and leaving the block: two round trips to the scheduler
and one :func:`rechunk_p2p.report`), and the scheduler's event loop, which builds the page
from its own state (:class:`rechunk_p2p.diagnostics.dashboard.RechunkPage`) once the
workers' heartbeats have caught up, and renders it with Bokeh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.spec import PLUGIN_NAME

#: Longest the scheduler waits for every worker's heartbeat after the block
HEARTBEAT_WAIT = 5.0


class performance_report:  # lower case, as distributed's: used the same way
    """Save the engine's page for the rechunks run inside a ``with`` block to ``filename``.

    The file holds the runs that finished (or were open) during the block, with their
    phases' progress and bytes, each worker's bytes and event-loop lag at the end, and the
    run report of :func:`rechunk_p2p.report`. Use beside distributed's own
    ``performance_report`` for its task stream and profiles. Works with a synchronous
    client (``with``) and an asynchronous one (``async with``). Needs ``bokeh``.

    Parameters
    ----------
    filename
        Where to write the HTML file.
    mode
        ``"cdn"`` (Bokeh's scripts loaded from its CDN when the file is opened: a small
        file) or ``"inline"`` (scripts in the file: opens offline).
    client
        The client of the cluster (default: the current one).

    Examples
    --------
    >>> with rechunk_p2p.performance_report("rechunk.html"):  # doctest: +SKIP
    ...     rechunk_p2p.rechunk(x, {0: -1}).to_zarr("out.zarr")
    """

    def __init__(
        self,
        filename: str | Path = "rechunk-p2p-report.html",
        mode: str = "cdn",
        client: Any = None,
    ) -> None:
        if mode not in ("cdn", "inline"):
            raise RechunkInputError(f"mode must be 'cdn' or 'inline', not {mode!r}")
        try:
            import bokeh  # noqa: F401
        except ImportError:
            raise RechunkInputError(
                "performance_report needs bokeh: pip install 'rechunk_p2p[dashboard]'"
            ) from None
        self.filename = Path(filename)
        self.mode = mode
        self._client = client
        self._start = 0.0

    def _get_client(self) -> Any:
        if self._client is None:
            from distributed import default_client

            self._client = default_client()
        return self._client

    def __enter__(self) -> performance_report:
        self._start = self._get_client().run_on_scheduler(time.time)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        from rechunk_p2p.diagnostics.run_report import report

        client = self._get_client()
        ids = client.run_on_scheduler(runs_since, self._start)
        table = _table(report(client), ids)
        html = client.run_on_scheduler(render_on_scheduler, self._start, self.mode, table)
        self.filename.write_text(html)

    async def __aenter__(self) -> performance_report:
        self._start = await self._get_client().run_on_scheduler(time.time)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        from rechunk_p2p.diagnostics.run_report import report

        client = self._get_client()
        ids = await client.run_on_scheduler(runs_since, self._start)
        table = _table(await cast(Awaitable[Any], report(client)), ids)  # (async client)
        html = await client.run_on_scheduler(render_on_scheduler, self._start, self.mode, table)
        self.filename.write_text(html)


def _table(report: Any, ids: list[str]) -> str:
    """The run report's rows of the runs ``ids``, as HTML."""
    return type(report)(tuple(r for r in report.runs if r.shuffle_id in ids))._repr_html_()


async def runs_since(since: float, dask_scheduler: Any = None) -> list[str]:
    """On the scheduler's loop: the sub-shuffles open now or finished since ``since``, once
    every worker's heartbeat is newer than the call (it carries their last runs' totals)."""
    from rechunk_p2p.diagnostics.live import METRIC
    from rechunk_p2p.diagnostics.live_view import live_view

    called = time.time()
    deadline = called + HEARTBEAT_WAIT
    while time.time() < deadline and any(
        (ws.metrics.get(METRIC) or {}).get("time", 0.0) < called
        for ws in dask_scheduler.workers.values()
    ):
        await asyncio.sleep(0.05)
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return []
    return [r.shuffle_id for r in live_view(dask_scheduler, plugin, since).runs]


def render_on_scheduler(since: float, mode: str, table: str, dask_scheduler: Any = None) -> str:
    """On the scheduler's loop: the page of the runs since ``since`` and ``table`` (the run
    report), as standalone HTML."""
    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.models.widgets.markups import Div
    from bokeh.resources import CDN, INLINE

    from rechunk_p2p.diagnostics.dashboard import RechunkPage

    page = RechunkPage(dask_scheduler, since=since)
    if PLUGIN_NAME in dask_scheduler.plugins:
        page.update()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    title = Div(text=f"<h2>rechunk_p2p: the rechunks since {stamp}</h2>")
    runs = Div(text=f"<h3>Run report</h3>{table}")
    layout = column(title, page.root, runs, sizing_mode="stretch_width")
    return file_html(layout, CDN if mode == "cdn" else INLINE, "rechunk_p2p performance report")
