"""docs/workflows.md's command lines parse (its Python blocks run in tests/test_doc_blocks.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from rechunk_p2p.cli import parse_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "workflows.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


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
