"""docs/workflows.md is tested: its Python examples run in order, its command lines parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rechunk_p2p.cli import parse_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "workflows.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


@pytest.mark.filterwarnings("ignore:Consolidated metadata:UserWarning")
def test_python_examples_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "workflows_doc"}
    examples = blocks("python")
    assert len(examples) >= 8
    try:
        for i, code in enumerate(examples):
            exec(compile(code, f"{DOC}, python block {i + 1}", "exec"), namespace)
    finally:
        for name in ("client", "cluster"):
            if name in namespace:
                namespace[name].close()
    out = capsys.readouterr().out
    assert "throughput" in out  # print(report)
    assert "already exists" in out  # the refused second rechunk
    assert {p.name for p in tmp_path.iterdir()} >= {
        "maps.zarr",
        "series.zarr",
        "series-sharded.zarr",
        "series-xr.zarr",
        "series-chunk.zarr",
    }


def test_command_lines_parse():
    commands = [
        line[2:]
        for block in blocks("console")
        for line in block.splitlines()
        if line.startswith("$ ")
    ]
    assert len(commands) >= 8
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "rechunk-p2p"
        parse_args(argv[1:])  # raises UsageError if the documented command is wrong
