"""The engine's page on the scheduler's dashboard, ``/rechunk-p2p``, built with Bokeh.

Where it runs: the scheduler's event loop. :func:`install` (from the scheduler plugin's
start) adds the page to the dashboard's running web application and links it from the
dashboard's "More..." menu, as distributed's own pages are; each open page refreshes from
:func:`rechunk_p2p.diagnostics.live_view.live_view` every :data:`REFRESH_MS`, which reads the
scheduler's state and the workers' last heartbeats only. Without bokeh or a dashboard
nothing is installed.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Mapping
from typing import Any

from dask.utils import format_bytes

from rechunk_p2p.diagnostics.live_view import LiveView, live_view
from rechunk_p2p.spec import PLUGIN_NAME

logger = logging.getLogger(__name__)

#: The page's path under the dashboard's prefix
ROUTE = "/rechunk-p2p"
#: How often an open page refreshes
REFRESH_MS = 500
#: The worker loop lag the page marks (the engine's bound on a worker's loop)
LAG_MARK_MS = 100
#: The lag plot's fixed axis: the mark stays in view whatever the lags (an axis fitted to
#: lags of a few ms left it off the plot), and so do stalls of several hundred ms; a longer
#: one fills the plot's width, its figure in the hover
LAG_AXIS_MS = 5 * LAG_MARK_MS

_RUN_COLUMNS = (
    ("label", "run"),
    ("phase", "phase"),
    ("transfers_text", "transfers"),
    ("outputs_text", "outputs"),
    ("sent_text", "sent"),
    ("memory_text", "in memory"),
    ("disk_text", "on disk"),
    ("workers", "workers"),
    ("changes", "workers changed"),
    ("seconds_text", "time"),
    ("loop_text", "loop max"),
)


def install(scheduler: Any) -> bool:
    """Add the page to ``scheduler``'s dashboard, once; whether it is there now."""
    application = getattr(scheduler, "http_application", None)
    if application is None or getattr(scheduler, "_rechunk_p2p_page", False):
        return bool(getattr(scheduler, "_rechunk_p2p_page", False))
    if not getattr(application, "applications", None):
        # no dashboard (``dashboard=False``, ``dashboard_address=None``): its other routes
        # (/metrics, /health) are served anyway; bokeh's import would take the scheduler's
        # loop for 0.4 s and add nothing anyone can see
        return False
    try:
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop
    except ImportError:  # no bokeh (or one distributed does not support): no dashboard
        return False
    variables = template_variables(scheduler)
    app = BokehApplication({ROUTE: page_doc}, scheduler, _prefix(application), variables)
    application.add_application(app)
    app.initialize(IOLoop.current())
    link = {"url": ROUTE.strip("/"), "name": "Rechunk P2P"}
    if link not in variables["plots"]:
        variables["plots"].append(link)  # the menu of every page made from now on
        variables["plots"].sort(key=lambda plot: plot["name"])
    scheduler._rechunk_p2p_page = True
    return True


def _prefix(application: Any) -> str:
    """The dashboard's URL prefix (``--dashboard-prefix``), from its Bokeh application."""
    for app in getattr(application, "applications", ()):
        prefix = getattr(app, "prefix", None)
        if isinstance(prefix, str):
            return prefix
    return "/"


class RechunkPage:
    """**Loop-confined.** The plots and tables of one open page, refreshed by :meth:`update`.

    Names (``rechunk-p2p-*``) identify the models for tests and for the browser.
    """

    def __init__(self, scheduler: Any, since: float | None = None) -> None:
        from bokeh.layouts import column, row
        from bokeh.models import (
            ColumnDataSource,
            DataRange1d,
            FactorRange,
            NumeralTickFormatter,
            Range1d,
        )
        from bokeh.models.annotations import Span
        from bokeh.models.widgets.markups import Div
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.since = since  # the finished runs shown: since then (default: the recent ones)
        self.runs = ColumnDataSource(_runs_data(LiveView((), ())), name="rechunk-p2p-runs")
        self.workers = ColumnDataSource(_workers_data(LiveView((), ())), name="rechunk-p2p-workers")
        self.summary = Div(text="No rechunk yet.", name="rechunk-p2p-summary")
        self._open_runs = FactorRange(factors=[])  # the progress chart's rows
        self._workers = FactorRange(factors=[])  # the per-worker charts' rows
        # an HTML table: Bokeh's DataTable does not redraw rows whose number did not change
        self.table = Div(text=_runs_html(self.runs.data), name="rechunk-p2p-run-table")
        self.progress = figure(
            title="Progress of the open runs: transfers, then outputs assembled",
            y_range=self._open_runs,
            x_range=Range1d(start=0, end=1),
            height=220,
            tools="",
            sizing_mode="stretch_width",
            name="rechunk-p2p-progress",
        )
        for part, height, color in (("transfers", 0.4, "#1f77b4"), ("outputs", 0.25, "#2ca02c")):
            self.progress.hbar(
                y="label",
                right=f"{part}_frac",
                height=height,
                source=self.runs,
                color=color,
                legend_label=part,
            )
        self.progress.xaxis.formatter = NumeralTickFormatter(format="0%")
        self.bytes = _per_worker(
            figure,
            "Per worker: pieces received and held, in memory and on disk",
            "rechunk-p2p-worker-bytes",
            [
                ("sent", "@sent_text"),
                ("received", "@received_text"),
                ("in memory", "@memory_text"),
                ("on disk", "@disk_text"),
                ("memory budget", "@memory_budget{0.0 b}"),
                ("queued to send", "@queued_text / @buffer_limit_text"),
            ],
            y_range=self._workers,
            x_range=DataRange1d(start=0),
        )
        self.bytes.hbar_stack(
            ["bytes_memory", "bytes_disk"],
            y="address",
            height=0.8,
            source=self.workers,
            color=["#1f77b4", "#ff7f0e"],
            legend_label=["in memory", "on disk"],
        )
        self.bytes.hbar(  # what storage auto keeps in memory before it spills
            y="address",
            right="memory_budget",
            height=0.8,
            source=self.workers,
            fill_alpha=0,
            line_color="red",
            line_dash="dashed",
            legend_label="memory budget",
        )
        self.bytes.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self.lag = _per_worker(
            figure,
            f"Per worker: event-loop lag over the last 10 s (ms; mark at {LAG_MARK_MS})",
            "rechunk-p2p-worker-lag",
            [("p99", "@lag_p99_ms{0.0} ms"), ("max", "@lag_max_ms{0.0} ms")],
            y_range=self._workers,
            x_range=Range1d(start=0, end=LAG_AXIS_MS, bounds=(0, None)),
        )
        self.lag.hbar(
            y="address",
            right="lag_max_ms",
            height=0.8,
            source=self.workers,
            color="lag_color",
            alpha=0.5,
            legend_label="max",
        )
        self.lag.hbar(
            y="address",
            right="lag_p99_ms",
            height=0.4,
            source=self.workers,
            color="#333333",
            legend_label="p99",
        )
        self.lag.add_layout(Span(location=LAG_MARK_MS, dimension="height", line_dash="dashed"))
        self.root = column(
            self.summary,
            self.table,
            self.progress,
            row(self.bytes, self.lag, sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )

    def update(self) -> None:
        plugin = self.scheduler.plugins.get(PLUGIN_NAME)
        if plugin is None:
            return
        view = live_view(self.scheduler, plugin, self.since)
        self.runs.data = _runs_data(view)
        self.workers.data = _workers_data(view)
        self.table.text = _runs_html(self.runs.data)
        self._open_runs.factors = [r.label for r in view.runs if r.phase in _OPEN]
        self._workers.factors = [w.address for w in view.workers]
        self.summary.text = _summary(view)


_OPEN = ("transfers", "assembling")


def _per_worker(figure: Any, title: str, name: str, tooltips: list, **ranges: Any) -> Any:
    """A plot with a bar per worker (hover: the worker and ``tooltips``)."""
    return figure(
        title=title,
        height=300,
        tools="hover",
        tooltips=[("worker", "@address"), *tooltips],
        sizing_mode="stretch_width",
        name=name,
        **ranges,
    )


def _runs_html(data: Mapping[str, Any]) -> str:
    """The runs as an HTML table, newest first."""
    cell = "padding:2px 12px;text-align:left;border-bottom:1px solid #ddd"
    head = "".join(f'<th style="{cell}">{html.escape(t)}</th>' for _, t in _RUN_COLUMNS)
    rows = "".join(
        "<tr>"
        + "".join(
            f'<td style="{cell}">{html.escape(str(data[f][i]))}</td>' for f, _ in _RUN_COLUMNS
        )
        + "</tr>"
        for i in range(len(data["label"]))
    )
    return f'<table style="border-collapse:collapse;font-size:90%"><tr>{head}</tr>{rows}</table>'


def _summary(view: LiveView) -> str:
    open_runs = [r for r in view.runs if r.phase in _OPEN]
    if not view.runs:
        return "No rechunk yet."
    sent = sum(r.bytes_sent for r in open_runs)
    return (
        f"<b>{len(open_runs)} run(s) open</b>, {len(view.runs) - len(open_runs)} finished "
        f"recently; {format_bytes(sent)} sent by the open runs; {len(view.workers)} workers"
    )


def _runs_data(view: LiveView) -> dict[str, list]:
    rows = view.runs
    return {
        "label": [r.label for r in rows],
        "shuffle_id": [r.shuffle_id for r in rows],
        "phase": [r.phase for r in rows],
        "transfers_frac": [r.transfers_done / r.transfers if r.transfers else 0.0 for r in rows],
        "outputs_frac": [r.outputs_done / r.outputs if r.outputs else 0.0 for r in rows],
        "transfers_text": [f"{r.transfers_done} / {r.transfers}" for r in rows],
        "outputs_text": [f"{r.outputs_done} / {r.outputs}" for r in rows],
        "sent_text": [format_bytes(r.bytes_sent) for r in rows],
        "memory_text": [format_bytes(r.bytes_memory) for r in rows],
        "disk_text": [format_bytes(r.bytes_disk) for r in rows],
        "workers": [r.workers for r in rows],
        "changes": [r.changes for r in rows],
        "seconds_text": [f"{r.seconds:.1f} s" for r in rows],
        # (the most any worker's loop lagged while the run was open there: what the
        # end-of-run summary's last line says of the workers)
        "loop_text": [f"{r.loop_max_ms:.0f} ms" for r in rows],
    }


def _workers_data(view: LiveView) -> dict[str, list]:
    rows = view.workers
    return {
        "address": [w.address for w in rows],
        "bytes_memory": [w.bytes_memory for w in rows],
        "bytes_disk": [w.bytes_disk for w in rows],
        "memory_budget": [w.memory_budget for w in rows],
        "sent_text": [format_bytes(w.bytes_sent) for w in rows],
        "received_text": [format_bytes(w.bytes_received) for w in rows],
        "memory_text": [format_bytes(w.bytes_memory) for w in rows],
        "disk_text": [format_bytes(w.bytes_disk) for w in rows],
        "queued_text": [format_bytes(w.bytes_queued) for w in rows],
        "buffer_limit_text": [format_bytes(w.buffer_limit) for w in rows],
        "lag_p99_ms": [w.lag_p99_ms for w in rows],
        "lag_max_ms": [w.lag_max_ms for w in rows],
        "lag_color": [
            "gray" if w.silent else "red" if w.lag_max_ms > LAG_MARK_MS else "#1f77b4" for w in rows
        ],
    }


def page_doc(scheduler: Any, extra: dict, doc: Any) -> None:
    """Fill ``doc`` (a new browser session) with a :class:`RechunkPage`."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = RechunkPage(scheduler)
    page.update()
    doc.title = "Dask: Rechunk P2P"
    add_periodic_callback(doc, page, REFRESH_MS)
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
