"""The package type-checks with mypy (configured in pyproject.toml), with no error."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import rechunk_p2p

pytest.importorskip("mypy")

ROOT = pathlib.Path(rechunk_p2p.__file__).parent.parent


def test_mypy_finds_no_error(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MYPY_FORCE_COLOR": "0"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("Success: no issues"), done.stdout
