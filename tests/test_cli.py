"""The ``rechunk-p2p`` command line: argument parsing in process, real runs as subprocesses."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from rechunk_p2p.cli import UsageError, main, parse_args, parse_chunks
from rechunk_p2p.integrations.demo import temperature_values
from tests.integrations.stores import SHAPE, arrays_of, assert_same_values, make_climate_group

REPO = Path(__file__).resolve().parents[1]
T, Y, X = SHAPE


def run_cli(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None):
    """``python -m rechunk_p2p ARGS`` in a fresh process, as a user would run it."""
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rechunk_p2p", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- parsing (in process) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("time=-1,lat=90,lon=180", {"time": -1, "lat": 90, "lon": 180}),
        ("0=-1, 2=auto", {0: -1, 2: "auto"}),
        ("365,90,180", (365, 90, 180)),
        ("-1", -1),
        ("auto", "auto"),
        ("64MiB", "64MiB"),
    ],
)
def test_parse_chunks(text, expected):
    assert parse_chunks(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        *("", "time=", "=5", "time=-1,5", "time=x", "time=0", "1,,2", "time=1,time=2", "lots"),
        # a bare number is a chunk size, never bytes; a byte size is positive
        *("0", "2.5", "-3", "-1000", "0B", "0MiB", "time=0MiB"),
    ],
)
def test_parse_chunks_refuses_malformed(text):
    with pytest.raises(UsageError, match="malformed --chunks"):
        parse_chunks(text)


def test_parse_args_picks_the_command():
    command, args = parse_args(["a.zarr", "b.zarr", "--chunks", "time=-1", "--workers", "3"])
    assert command.__name__ == "run_command"
    assert (args.source, args.target, args.chunks, args.workers) == (
        "a.zarr",
        "b.zarr",
        {"time": -1},
        3,
    )
    command, args = parse_args(["plan", "a.zarr", "--chunks", "10,10"])
    assert command.__name__ == "plan_command" and args.chunks == (10, 10)
    command, args = parse_args(["demo"])
    assert command.__name__ == "demo_command" and args.size == 256 * 2**20


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a", "b", "--chunks", "1", "--scheduler", "x:1", "--workers", "2"], "exclude"),
        (["a", "b"], "--chunks"),
        (["a", "b", "--chunks", "1", "--workers", "0"], "positive"),
        (["demo", "--size", "lots"], "256MiB"),
        (["a", "b", "--chunks", "1", "--bogus"], "unrecognized"),
        (["a", "b", "--chunks", "1", "--resume", "--overwrite"], "exclude each other"),
        (["a", "b", "--chunks", "0"], "'0' is not a positive size"),
    ],
)
def test_usage_errors(argv, message, capsys):
    with pytest.raises(UsageError, match=message):
        parse_args(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rechunk-p2p: error:")


def test_demo_values_do_not_depend_on_the_block():
    """The demo verifies by equality: values must be the same whatever block they are in."""
    whole = temperature_values(0, 40, 0, 180, 0, 360, n_time=40)
    part = temperature_values(7, 19, 33, 101, 250, 360, n_time=40)
    np.testing.assert_array_equal(whole[7:19, 33:101, 250:360], part)
    assert whole.dtype == np.float32 and 200 < whole.mean() < 320


# --- real runs (subprocesses) ------------------------------------------------------------


def test_rechunk_command(tmp_path):
    make_climate_group(tmp_path / "src.zarr", 3)

    result = run_cli(
        "src.zarr",
        "tgt.zarr",
        "--chunks",
        "time=-1,lat=5",
        "--workers",
        "2",
        "--threads-per-worker",
        "1",
        "--memory-limit",
        "1GiB",
        "--dashboard",
        cwd=tmp_path,
    )

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert re.match(r"watch it at http://[^ ]+:\d+/rechunk-p2p\n", result.stdout)
    for words in ("rechunked", "bytes:", "time:", "throughput:", "spilled to disk:", "p99"):
        assert words in result.stdout, words
    target = arrays_of(tmp_path / "tgt.zarr")
    assert tuple(target["temperature"].chunks) == (T, 5, X)
    for name, arr in arrays_of(tmp_path / "src.zarr").items():
        assert_same_values(arr, target[name])


def test_plan_command_runs_nothing(tmp_path):
    make_climate_group(tmp_path / "src.zarr", 2)

    result = run_cli(
        "plan", "src.zarr", "--chunks", "time=-1,lat=5", "--workers", "4", cwd=tmp_path
    )

    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "zarr format 2" in out
    assert "temperature (time, lat, lon) float32" in out
    assert f"chunks (1, {Y}, {X}) -> ({T}, 5, {X})" in out
    assert "estimate for 4 workers" in out
    assert "lon (lon) float64" in out and "copied as it is" in out
    assert f"lat (lat) float64 {Y * 8} B: copied as it is (chunks ({Y},))" in out
    assert sorted(os.listdir(tmp_path)) == ["src.zarr"]
    included = run_cli(
        "plan", "src.zarr", "--chunks", "time=-1,lat=5", "--include-coords", cwd=tmp_path
    )
    assert included.returncode == 0, included.stderr
    assert f"lat (lat) float64 {Y * 8} B: chunks ({Y},) -> (5,)" in included.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("missing.zarr", "tgt.zarr", "--chunks", "time=-1"), "does not exist"),
        (("src.zarr", "exists.zarr", "--chunks", "time=-1"), "already exists"),
        (("src.zarr", "tgt.zarr", "--chunks", "time=-1,level=2"), "unknown dimension"),
        (("src.zarr", "tgt.zarr", "--chunks", "time=-1,90"), "malformed --chunks"),
        (
            (
                "src.zarr",
                "tgt.zarr",
                "--chunks",
                "time=-1",
                "--scheduler",
                "tcp://127.0.0.1:1",
                "--connect-timeout",
                "1s",
            ),
            "cannot reach the scheduler",
        ),
    ],
)
def test_errors_are_one_line(tmp_path, args, message):
    make_climate_group(tmp_path / "src.zarr", 3)
    (tmp_path / "exists.zarr").mkdir()
    zarr.open_group(tmp_path / "exists.zarr", mode="w")

    with contextlib.ExitStack() as held:  # distributed's default port taken (another
        with contextlib.suppress(OSError):  # command running): no warning about it either
            held.enter_context(socket.create_server(("127.0.0.1", 8787)))
        result = run_cli(*args, cwd=tmp_path, timeout=60)

    assert result.returncode in (1, 2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rechunk-p2p: error:") and message in lines[0]
    assert not (tmp_path / "tgt.zarr").exists()


def test_demo_command(tmp_path):
    result = run_cli(
        "demo",
        "--size",
        "4MiB",
        "--workers",
        "2",
        "--threads-per-worker",
        "1",
        cwd=tmp_path,
        env={"TMPDIR": str(tmp_path)},
    )

    assert result.returncode == 0, result.stderr
    assert "verified: all" in result.stdout
    assert "throughput" in result.stdout and "p99" in result.stdout
    assert re.match(r"watch it at http://[^ ]+:\d+/rechunk-p2p\n", result.stdout)  # bokeh is in
    assert not list(tmp_path.glob("rechunk-p2p-demo-*"))  # the demo cleans up after itself


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_scheduler_address_that_is_not_a_scheduler_is_one_line_within_the_timeout(
    tmp_path, answer
):
    """A dashboard's port (it waits for a request) or a peer that answers garbage: one line
    within --connect-timeout, no traceback, nothing written."""
    make_climate_group(tmp_path / "src.zarr", 3)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        if answer is not None:
            talker = threading.Thread(target=lambda: listening.accept()[0].sendall(answer))
            talker.start()
        start = time.monotonic()
        result = run_cli(
            *("src.zarr", "tgt.zarr", "--chunks", "time=-1"),
            *("--scheduler", f"tcp://127.0.0.1:{port}", "--connect-timeout", "2s"),
            cwd=tmp_path,
            timeout=60,
        )
        took = time.monotonic() - start
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    expected = "sent nothing within 2 s" if answer is None else "answered b'HTTP/1.1'"
    assert (
        lines[0].startswith("rechunk-p2p: error: cannot reach the scheduler")
        and expected in lines[0]
    )
    assert took < 30  # the command's start-up and the 2 s, not distributed's own waits
    assert not (tmp_path / "tgt.zarr").exists()
