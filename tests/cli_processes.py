"""``dask scheduler`` / ``dask worker`` processes for tests, started as the CLI starts them.

Where it runs: the test process (it starts and stops the subprocesses).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def cli_env() -> dict[str, str]:
    """The environment of a started process: this checkout importable."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def start(module: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    """``python -m distributed.cli.<module> ...``: what ``dask scheduler``/``dask worker`` run."""
    # a file, not a pipe (a full pipe would block a chatty process); stop closes it
    log = tempfile.TemporaryFile()  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", f"distributed.cli.{module}", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    process.log = log  # type: ignore[attr-defined]
    return process


def stop(process: subprocess.Popen) -> str:
    """Terminate the process; return the end of its log."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with process.log:  # type: ignore[attr-defined]
        process.log.seek(0)  # type: ignore[attr-defined]
        return process.log.read().decode(errors="replace")[-3000:]  # type: ignore[attr-defined]


def start_scheduler(scheduler_file: str, env: dict[str, str]) -> subprocess.Popen:
    """``dask scheduler --preload rechunk_p2p``, waited for until its file exists."""
    scheduler = start(
        "dask_scheduler",
        *("--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0"),
        *("--scheduler-file", scheduler_file, "--preload", "rechunk_p2p"),
        env=env,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(scheduler_file):
        assert scheduler.poll() is None, stop(scheduler)
        assert time.monotonic() < deadline, "the scheduler did not start"
        time.sleep(0.1)
    return scheduler


def start_worker(
    scheduler_file: str, local_directory: str, env: dict[str, str]
) -> subprocess.Popen:
    """``dask worker --no-nanny`` with one thread in ``local_directory``."""
    return start(
        "dask_worker",
        *("--scheduler-file", scheduler_file, "--nthreads", "1", "--no-nanny"),
        *("--dashboard-address", ":0", "--local-directory", local_directory),
        env=env,
    )


def start_nanny_worker(
    scheduler_file: str, local_directory: str, env: dict[str, str], memory_limit: str
) -> subprocess.Popen:
    """``dask worker`` with its nanny (which restarts a killed worker process), one thread
    and ``memory_limit``, in ``local_directory``."""
    return start(
        "dask_worker",
        *("--scheduler-file", scheduler_file, "--nthreads", "1"),
        *("--memory-limit", memory_limit, "--dashboard-address", ":0"),
        *("--local-directory", local_directory),
        env=env,
    )
