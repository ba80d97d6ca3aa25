"""A zarr rechunk stopped half way leaves its target absent, complete or resumable, never junk;
``resume`` finishes it, rewriting only the chunks without a completion record."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import zarr

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.integrations.zarr import rechunk_zarr
from rechunk_p2p.integrations.zarr_writes import (
    DONE,
    RUN_RECORD,
    missing_keys,
    write_arrays,
)
from tests.cli_processes import cli_env

from .stores import arrays_of, assert_same_values, make_climate_group

CHUNKS = {"time": -1, "lat": 5}


def records(target: Path) -> list[Path]:
    return sorted(p for p in (target / DONE).rglob("*") if p.is_file())


def interrupted_copy(src: Path, target: Path, monkeypatch, lose: int) -> list[Path]:
    """``target`` as a run stopped after all but ``lose`` chunks of ``temperature`` were
    recorded: a run that never finished (its records kept), then ``lose`` completion records
    removed and those chunks torn (truncated, as a kill during the write leaves them).
    Returns the torn chunk files."""
    with monkeypatch.context() as m:
        m.setattr("rechunk_p2p.integrations.zarr.finish_run", lambda store: None)
        rechunk_zarr(src, target, CHUNKS, progress=False)
    assert (target / RUN_RECORD).exists()
    arrays = sorted(n for n in arrays_of(src))  # the layouts' order (by name)
    done = target / DONE / str(arrays.index("temperature"))
    torn = []
    for record in sorted(done.iterdir())[:lose]:
        chunk = target / "temperature" / "c" / Path(*record.name.split("."))
        chunk.write_bytes(chunk.read_bytes()[:7])
        record.unlink()
        torn.append(chunk)
    return torn


def test_resume_rewrites_exactly_the_chunks_without_a_record(p2p_client, tmp_path, monkeypatch):
    src, target = tmp_path / "src.zarr", tmp_path / "out.zarr"
    make_climate_group(src, 3)
    torn = interrupted_copy(src, target, monkeypatch, lose=2)
    total = len(records(target)) + 2

    with pytest.raises(RechunkInputError, match="unfinished rechunk_p2p run; pass resume"):
        rechunk_zarr(src, target, CHUNKS, progress=False)
    report = rechunk_zarr(src, target, CHUNKS, resume=True, progress=False)

    assert (report.chunks_written, report.chunks_resumed) == (2, total - 2)
    assert "2 written, " in str(report)
    for name, arr in arrays_of(src).items():
        assert_same_values(arr, arrays_of(target)[name])
    assert all(p.stat().st_size > 7 for p in torn)
    assert not (target / ".rechunk-p2p").exists()
    group = zarr.open_group(target, mode="r")
    assert group.metadata.consolidated_metadata is not None


def test_resume_ignores_and_removes_the_temporary_files_of_writes_a_kill_cut_short(
    p2p_client, tmp_path, monkeypatch
):
    """zarr's local store writes a key to a temporary file, then renames it: a kill in between
    leaves ``<name>.<uuid hex>.partial``, beside a chunk or among the completion records."""
    src, target = tmp_path / "src.zarr", tmp_path / "out.zarr"
    make_climate_group(src, 3)
    (torn,) = interrupted_copy(src, target, monkeypatch, lose=1)
    stray = [
        torn.with_suffix(f".{uuid.uuid4().hex}.partial"),
        records(target)[0].with_suffix(f".{uuid.uuid4().hex}.partial"),
    ]
    for path in stray:
        path.write_bytes(b"\x00" * 5)

    report = rechunk_zarr(src, target, CHUNKS, resume=True, progress=False)

    assert report.chunks_written == 1
    assert_same_values(arrays_of(src)["temperature"], arrays_of(target)["temperature"])
    assert not any(p.exists() for p in stray)
    assert not [p for p in target.rglob("*") if p.name.endswith(".partial")]


def test_resume_refuses_a_different_run_and_a_finished_target(p2p_client, tmp_path, monkeypatch):
    src, target = tmp_path / "src.zarr", tmp_path / "out.zarr"
    make_climate_group(src, 3)
    interrupted_copy(src, target, monkeypatch, lose=1)
    with pytest.raises(
        RechunkInputError,
        match=r"array 'orography' had chunks \[5, 12\] in the interrupted run, \[2, 12\] now",
    ):
        rechunk_zarr(src, target, {"time": -1, "lat": 2}, resume=True, progress=False)
    with pytest.raises(RechunkInputError, match=r"zarr_format 3, this one 2"):
        rechunk_zarr(src, target, CHUNKS, resume=True, zarr_format=2, progress=False)
    with pytest.raises(RechunkInputError, match=r"exclude each other"):
        rechunk_zarr(src, target, CHUNKS, resume=True, overwrite=True, progress=False)
    rechunk_zarr(src, target, CHUNKS, resume=True, progress=False)
    with pytest.raises(RechunkInputError, match="holds no unfinished rechunk_p2p run"):
        rechunk_zarr(src, target, CHUNKS, resume=True, progress=False)
    with pytest.raises(RechunkInputError, match="does not exist"):
        rechunk_zarr(src, tmp_path / "none.zarr", CHUNKS, resume=True, progress=False)
    assert not (tmp_path / "none.zarr").exists()


def test_an_interrupt_while_the_writes_are_built_says_how_to_resume(p2p_client, tmp_path):
    """Ctrl-C can land after the target is created and before its writes are submitted (the
    graph of a large run takes a while to build): the same note as during the writes."""
    src, target = tmp_path / "src.zarr", tmp_path / "out.zarr"
    make_climate_group(src, 3)

    def interrupt(*args):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m, pytest.raises(KeyboardInterrupt) as info:
        m.setattr("rechunk_p2p.integrations.zarr.missing_keys", interrupt)
        rechunk_zarr(src, target, CHUNKS, progress=False)
    assert any("resume it with resume=True" in n for n in info.value.__notes__), info.value
    rechunk_zarr(src, target, CHUNKS, resume=True, progress=False)
    for name, arr in arrays_of(src).items():
        assert_same_values(arr, arrays_of(target)[name])


def test_overwrite_replaces_an_unfinished_run_and_its_stray_chunks(p2p_client, tmp_path):
    src, target = tmp_path / "src.zarr", tmp_path / "out.zarr"
    make_climate_group(src, 3)
    (target / ".rechunk-p2p").mkdir(parents=True)
    (target / RUN_RECORD).write_text("{")  # torn while written
    stray = target / "temperature" / "c" / "0" / "2" / "1"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"junk")

    with pytest.raises(RechunkInputError, match="run record is unreadable"):
        rechunk_zarr(src, target, CHUNKS, resume=True, progress=False)
    rechunk_zarr(src, target, CHUNKS, overwrite=True, progress=False)
    assert not stray.exists()
    assert_same_values(arrays_of(src)["temperature"], arrays_of(target)["temperature"])


def test_a_resume_reads_only_what_the_missing_chunks_need(tmp_path):
    """The culled graph of one missing output reads only the source chunks it needs."""
    import rechunk_p2p

    source = zarr.create_array(tmp_path / "a.zarr", shape=(64, 64), chunks=(4, 64), dtype="f8")
    y = rechunk_p2p.rechunk(da.from_zarr(source), (16, 8))
    target = zarr.create_array(tmp_path / "b.zarr", shape=(64, 64), chunks=(16, 8), dtype="f8")
    (written,) = write_arrays([y], [target], None)
    all_blocks = set(np.ndindex(*written.numblocks))

    def reads(done: set) -> int:
        graph = dict(da.Array.__dask_optimize__(*missing_keys([written], [done])))
        return sum(isinstance(k, tuple) and "from-zarr" in k[0] for k in graph)

    assert reads(set()) >= 16
    assert reads(all_blocks - {(0, 3)}) == 4  # rows 0-15: 4 source chunks of 4 rows


# -- real processes: the CLI interrupted -----------------------------------------------


def make_source(path: Path, steps: int) -> None:
    """Maps of (steps, 256, 256) float32, one step a chunk, known values."""
    g = zarr.open_group(path, mode="w", zarr_format=3)
    a = g.create_array(
        "t2m",
        shape=(steps, 256, 256),
        chunks=(1, 256, 256),
        dtype="f4",
        dimension_names=("time", "lat", "lon"),
    )
    a[...] = np.arange(steps * 256 * 256, dtype="f4").reshape(steps, 256, 256)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rechunk_p2p", *args]


RUN = ("--chunks", "time=-1,lat=32,lon=32", "--workers", "2", "--threads-per-worker", "1")


def stop_cli_when_writing(src: Path, target: Path, sig: int, after: float) -> tuple[int, str]:
    """Start the CLI in its own process group, signal the group ``after`` seconds once the
    target exists (as a terminal's Ctrl-C does), and return its exit code and stderr."""
    p = subprocess.Popen(
        cli(str(src), str(target), *RUN, "--no-progress"),
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as a terminal starts it: Ctrl-C not ignored (a background job inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (target / "zarr.json").exists() and p.poll() is None:
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=after)
    if p.poll() is None:  # SIGTERM as `kill PID` sends it; the others to the whole group
        os.kill(p.pid, sig) if sig == signal.SIGTERM else os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=240)
    return p.returncode, err


def assert_absent_complete_or_resumable(src: Path, target: Path) -> str:
    if not target.exists():
        return "absent"
    if (target / RUN_RECORD).exists():
        subprocess.run(cli(str(src), str(target), *RUN, "--resume"), env=cli_env(), check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        state = "resumed"
    else:
        state = "complete"
    np.testing.assert_array_equal(
        zarr.open_array(src / "t2m", mode="r")[...], zarr.open_array(target / "t2m", mode="r")[...]
    )
    assert not (target / ".rechunk-p2p").exists()
    return state


def test_ctrl_c_prints_one_line_and_leaves_a_resumable_target(tmp_path):
    """A larger source if the run finished before the interrupt came (a fast machine)."""
    for steps in (256, 1024, 4096):
        src, target = tmp_path / f"src{steps}.zarr", tmp_path / f"out{steps}.zarr"
        make_source(src, steps)
        code, err = stop_cli_when_writing(src, target, signal.SIGINT, after=0.1)
        if code != 0:
            break
    assert code == 130, err
    assert len(err.strip().splitlines()) == 1, err
    assert "interrupted; " in err and "--resume" in err
    assert assert_absent_complete_or_resumable(src, target) in ("absent", "resumed")


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> tuple[Path, float]:
    """A source of 256 maps, and how long the CLI's run takes from creating the target."""
    src = tmp_path_factory.mktemp("big") / "src.zarr"
    make_source(src, 256)
    target = src.parent / "timed.zarr"
    start = time.monotonic()
    code, err = stop_cli_when_writing(src, target, signal.SIGINT, after=3600)
    assert code == 0, err
    return src, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(10))
def test_killed_and_resumed_ten_times(big_source, tmp_path, round_):
    """Ctrl-C to the process group, SIGTERM to the client, or the client and its local
    cluster SIGKILLed, at points spread over the run: the target is always absent,
    complete, or resumed to equal the source; an interrupt prints one line."""
    src, seconds = big_source
    target = tmp_path / "out.zarr"
    sig = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[round_ % 3]
    code, err = stop_cli_when_writing(src, target, sig, after=seconds * (round_ + 0.5) / 20)
    if sig != signal.SIGKILL and code == -sig:  # during the interpreter's exit (default handlers)
        assert (target / "zarr.json").exists() and not (target / RUN_RECORD).exists()
    elif sig != signal.SIGKILL and code != 0:
        assert code == 130 and len(err.strip().splitlines()) == 1, (code, err)
    print(sig.name, code, assert_absent_complete_or_resumable(src, target))


@pytest.mark.slow
def test_a_killed_client_is_resumed_on_the_cluster_that_outlived_it(big_source, tmp_path):
    """``dask scheduler`` and two ``dask worker`` processes; the CLI client alone SIGKILLed
    at four points of its run, the run resumed on the same cluster (whose writes in progress
    the resume waits for): the target equals the source every time."""
    import json

    from tests.cli_processes import start_scheduler, start_worker, stop

    src, seconds = big_source
    env = cli_env()
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler = start_scheduler(scheduler_file, env)
    workers = [start_worker(scheduler_file, str(tmp_path / f"w{i}"), env) for i in range(2)]
    try:
        address = json.loads(Path(scheduler_file).read_text())["address"]
        for k in range(4):
            target = tmp_path / f"out{k}.zarr"
            cmd = cli(str(src), str(target), *RUN[:2], "--scheduler", address, "--no-progress")
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while not (target / "zarr.json").exists() and p.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=seconds * (k + 1) / 10)
            p.kill()
            p.wait()
            if (target / RUN_RECORD).exists():
                resume = [*cmd, "--resume"]
                subprocess.run(resume, env=env, check=True, stdout=subprocess.DEVNULL)
            np.testing.assert_array_equal(
                zarr.open_array(src / "t2m", mode="r")[...],
                zarr.open_array(target / "t2m", mode="r")[...],
            )
            assert not (target / ".rechunk-p2p").exists()
    finally:
        for process in [*workers, scheduler]:
            stop(process)
