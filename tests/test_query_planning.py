"""dask's array query planning: the engine works there too (checks in a subprocess).

dask.array reads ``array.query-planning`` once, at import; this process runs with it off (the
rest of the suite), ``tests/query_planning_checks.py`` runs in a subprocess with it on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_engine_under_array_query_planning():
    env = {**os.environ, "DASK_ARRAY__QUERY_PLANNING": "True"}
    command = [sys.executable, "-m", "pytest", "tests/query_planning_checks.py", "-q"]
    command += ["-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    match = re.search(r"(\d+) passed", proc.stdout)
    assert match and int(match.group(1)) == 4, proc.stdout[-2000:]
