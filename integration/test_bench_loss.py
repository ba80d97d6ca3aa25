"""The worker-loss benchmark end to end, small: a continuation against a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration import bench_loss


@pytest.mark.slow  # (the benchmark's own run: pytest -m slow integration)
def test_bench_loss_continues_and_sends_less_than_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "loss.json"
    assert bench_loss.main(["--size", "384MiB", "--repeat", "1", "--out", str(out)]) == 0
    runs = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"continue", "restart"}
    kept, restarted = runs["continue"], runs["restart"]
    assert (kept["continuations"], kept["restarts"], kept["runs"]) == (1, 0, 1)
    assert (restarted["continuations"], restarted["restarts"], restarted["runs"]) == (0, 1, 2)
    # a restart sends every cross-worker piece again; a continuation only the moved outputs'
    assert 0 < kept["bytes_sent_after_kill"] < restarted["bytes_sent_after_kill"] / 2
    # outputs the survivors had finished stay finished: only pending and lost ones are assembled
    # (a result in flight at the kill can count twice: it lands, then is lost with the victim)
    pending = kept["outputs_total"] - kept["outputs_done_at_kill"]
    assert pending <= kept["outputs_after_kill"] <= pending + kept["victim_outputs"]
    assert "| continue |" in capsys.readouterr().out
