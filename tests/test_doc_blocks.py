"""Every Python block in README.md and docs/ runs as written: each is extracted from its file
and run as a script in a subprocess (``__name__ == "__main__"``, as a user pasting it into a
file runs it), the blocks of one file in order in one directory.

A block may be preceded by ``<!-- docs-test: replace "A" "B" -->`` (run at a smaller size,
where the text around it says so). README's xarray examples read ``maps.zarr``, which
docs/workflows.md makes: its first block runs first for README. docs/workflows.md's sample of
the demo's summary is checked against the lines a real report prints.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_processes import cli_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"(?:<!-- docs-test: (?P<directive>.*?) -->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M
)


def python_blocks(path: Path) -> list[str]:
    """The Python blocks of ``path``, with their ``replace`` directives applied."""
    blocks = []
    for match in _BLOCK.finditer(path.read_text()):
        code, directive = match["code"], match["directive"]
        if directive:
            verb, *args = shlex.split(directive)
            assert verb == "replace" and len(args) == 2, directive
            assert args[0] in code, f"{path.name}: {args[0]!r} is not in the block"
            code = code.replace(args[0], args[1])
        blocks.append(code)
    return blocks


def run_block(code: str, where: Path, name: str) -> str:
    script = where / f"{name}.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=where,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{name} failed:\n{code}\n{done.stderr[-4000:]}"
    return done.stdout


def test_every_doc_with_python_is_covered():
    with_python = {p.name for p in DOCS if python_blocks(p)}
    assert with_python == {"README.md", "workflows.md", "event-loop.md"}


@pytest.mark.parametrize("doc", ["workflows.md", "README.md", "event-loop.md"])
def test_python_blocks_run_as_written(doc, tmp_path):
    path = next(p for p in DOCS if p.name == doc)
    blocks = python_blocks(path)
    if doc == "README.md":
        run_block(python_blocks(ROOT / "docs" / "workflows.md")[0], tmp_path, "maps")
    outputs = [run_block(code, tmp_path, f"block{i + 1}") for i, code in enumerate(blocks)]
    if doc == "workflows.md":
        check_workflows(path, outputs, tmp_path)


def check_workflows(path: Path, outputs: list[str], where: Path) -> None:
    """What the blocks print and leave behind, and the demo sample's lines."""
    everything = "\n".join(outputs)
    assert "already exists" in everything and "Chunk size 0 along axis 0" in everything
    assert "{'chunks': " in everything  # to_dask() returned a count
    made = {p.name for p in where.iterdir()}
    assert made >= {"maps.zarr", "series.zarr", "series-sharded.zarr", "series2.zarr"}
    assert made >= {"series3.zarr", "series-xr.zarr", "series-chunk.zarr"}
    report = next(o for o in outputs if o.startswith("rechunked "))
    sample = re.search(r"<!-- demo-output -->\n```text\n(.*?)```", path.read_text(), re.S)
    assert sample is not None
    labels = [line.split(":")[0] for line in report.splitlines()[1:]]
    lines = sample[1].splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("rechunked "))
    assert [line.split(":")[0] for line in lines[start + 1 :]] == labels
