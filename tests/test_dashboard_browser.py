"""The /rechunk-p2p page in a real browser during a real rechunk on a multi-process
LocalCluster: the page renders its table and plots, shows the run in its phases and the
workers' bars, and the event loops stay within bounds while it is open.

Skipped where no Chromium is installed, unless ``RECHUNK_P2P_REQUIRE_BROWSER=1`` (CI installs
Debian's ``chromium`` and sets it, so there it fails instead). ``RECHUNK_P2P_SCREENSHOT=path``
keeps the screenshot (docs/img/dashboard.png is made that way).
"""

from __future__ import annotations

import os
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import rechunk_p2p
from rechunk_p2p.diagnostics import measure_event_loops
from tests.browser import Browser, find_browser

pytest.importorskip("bokeh")
BROWSER = find_browser()
if BROWSER is None and os.environ.get("RECHUNK_P2P_REQUIRE_BROWSER") != "1":
    pytest.skip("no Chromium installed (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.browser

#: What the page shows, read from inside its shadow DOM (Bokeh 3 renders there): the text
#: of the run table's cells, the painted canvases, and the data behind the plots.
_PAGE_STATE = """(() => {
  const out = {cells: [], canvases: 0, runs: null, workers: null};
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'TD') out.cells.push(el.textContent);
      if (el.tagName === 'CANVAS' && el.width > 0 && el.height > 0) out.canvases++;
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  const doc = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
  const data = (name) => {
    const model = doc && doc.get_model_by_name(name);
    if (!model) return null;
    const d = model.data;
    const entries = d instanceof Map ? [...d.entries()] : Object.entries(d);
    return Object.fromEntries(entries.map(([k, v]) => [k, Array.from(v)]));
  };
  out.runs = data('rechunk-p2p-runs');
  out.workers = data('rechunk-p2p-workers');
  return JSON.stringify(out);
})()"""


def _slow_block(block: np.ndarray) -> np.ndarray:
    time.sleep(0.04)  # a slow source: the run stays in its transfer phase for seconds
    return block + 1


def _wait_for(browser: Browser, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    state: dict = {}
    while time.monotonic() < deadline:
        state = browser.evaluate(_PAGE_STATE) or {}
        if predicate(state):
            return state
        time.sleep(0.2)
    raise AssertionError(f"the page never showed {what}; last state: {state}")


def _open_rows(state: dict) -> bool:
    """An open run in the data and in the rendered table."""
    runs = state.get("runs") or {}
    rows = zip(runs.get("label", []), runs.get("phase", []))
    return any(p in ("transfers", "assembling") and lb in state["cells"] for lb, p in rows)


def _phase_of(state: dict, label: str) -> str | None:
    runs = state.get("runs") or {}
    if label not in state["cells"]:
        return None  # not rendered yet
    return dict(zip(runs.get("label", []), runs.get("phase", []))).get(label)


def _workers_hold_pieces(state: dict) -> bool:
    workers = state.get("workers") or {}
    return len(workers.get("address", [])) == 2 and sum(workers.get("bytes_memory", [])) > 0


@pytest.mark.timeout(300)
def test_the_page_shows_a_rechunk_while_it_runs(tmp_path):
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        rechunk_p2p.rechunk(da.ones((8, 8), chunks=(1, 8)), (8, 1)).sum().compute()
        workers = sorted(client.scheduler_info()["workers"])
        url = cluster.dashboard_link.replace("/status", "/rechunk-p2p")
        with Browser(BROWSER) as browser:
            browser.open(url)
            _wait_for(browser, lambda s: s.get("runs") is not None, 60, "its document")
            x = da.random.RandomState(1).random((512, 16384), chunks=(2, 16384))  # 64 MiB
            slow = x.map_blocks(_slow_block, dtype=x.dtype)  # (made inside the transfers)
            transfers = rechunk_p2p.plan(slow, (512, 128), n_workers=2).n_transfers
            y = rechunk_p2p.rechunk(slow, (512, 128))
            with measure_event_loops(client) as probe:
                future = client.compute(y.sum())
                during = _wait_for(browser, _open_rows, 60, "an open run")
                pieces = _wait_for(browser, _workers_hold_pieces, 60, "pieces on both workers")
                path = os.environ.get("RECHUNK_P2P_SCREENSHOT") or tmp_path / "page.png"
                shot = browser.screenshot(path)  # mid-run: the bars of both workers
                total = future.result(timeout=120)
            assert total == pytest.approx(float((x + 1).sum().compute()))
            row = next(i for i, p in enumerate(during["runs"]["phase"]) if p != "done")
            label, phase = during["runs"]["label"][row], during["runs"]["phase"][row]
            after = _wait_for(browser, lambda s: _phase_of(s, label) == "done", 30, "it done")
    assert label in during["cells"] and phase in during["cells"]  # the table shows the run
    done_row = after["cells"].index(label)
    progress = ["done", f"{transfers} / {transfers}", "128 / 128"]
    assert after["cells"][done_row + 1 : done_row + 4] == progress
    assert after["runs"]["outputs_text"][after["runs"]["label"].index(label)] == "128 / 128"
    assert during["canvases"] >= 3  # the progress, bytes and lag plots were painted
    assert sorted(pieces["workers"]["address"]) == workers
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    # the loops stayed responsive with the page open and refreshing (generous bounds: the
    # browser shares the machine's cores; integration/test_event_loop.py holds the tight ones)
    worst = max(s.max_ms for s in probe.report.workers().values())
    assert worst < 1000, str(probe.report)
