"""Resume after a kill: a zarr rechunk SIGKILLed (client and local cluster) once half of its
chunks are written, then resumed, against the same rechunk run whole.

Run: ``PYTHONPATH=. .venv/bin/python -m integration.bench_resume --size 1GiB --repeat 2``.
Each run is the command line on a fresh local cluster (``--workers``, 1 thread each); the
source is maps of float32 (one time step a chunk, or ``--source-chunks``) rechunked to time
series of 32 x 32 tiles. With whole maps every missing output reads every source chunk, so a
resume decodes the whole source again; with tiles (``--source-chunks 8,128,128``) it reads
only those that feed the missing outputs. Prints per
repeat the full run's time, the share of chunks written when the kill came, the resumed
run's time and their ratio, and the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from dask.utils import format_bytes, parse_bytes

from rechunk_p2p.integrations.zarr_writes import DONE

SIDE = 512


def make_source(path: Path, nbytes: int, chunks: tuple[int, int, int] = (1, SIDE, SIDE)) -> int:
    """Maps of (steps, 512, 512) float32 in ``chunks``; returns the step count."""
    steps = max(8, nbytes // (SIDE * SIDE * 4))
    g = zarr.open_group(path, mode="w", zarr_format=3)
    a = g.create_array(
        "t2m",
        shape=(steps, SIDE, SIDE),
        chunks=chunks,
        dtype="f4",
        dimension_names=("time", "lat", "lon"),
    )
    rng = np.random.default_rng(0)
    for start in range(0, steps, 64):
        stop = min(steps, start + 64)
        a[start:stop] = rng.random((stop - start, SIDE, SIDE), dtype="f4")
    return steps


def command(src: Path, target: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rechunk_p2p",
        str(src),
        str(target),
        *("--chunks", "time=-1,lat=32,lon=32", "--no-progress"),
        *("--workers", str(args.workers), "--threads-per-worker", "1"),
        *extra,
    ]


def timed(cmd: list[str]) -> float:
    os.sync()  # each run starts with no dirty pages of the one before to write back
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr}")
    return seconds


def killed_at(cmd: list[str], target: Path, total: int, share: float) -> float:
    """Run ``cmd`` in its own process group and SIGKILL the group once ``share`` of the
    ``total`` chunks have completion records; the share written when it died."""
    os.sync()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    done = target / DONE / "0"
    while p.poll() is None:
        written = len(os.listdir(done)) if done.is_dir() else 0
        if written >= share * total:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            break
        time.sleep(0.005)
    return (len(os.listdir(done)) if done.is_dir() else total) / total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m integration.bench_resume", description=__doc__)
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--share", type=float, default=0.5, help="chunks written when killed")
    p.add_argument(
        "--source-chunks", default=f"1,{SIDE},{SIDE}", help="time,lat,lon (default: maps)"
    )
    args = p.parse_args(argv)
    chunks = tuple(int(n) for n in args.source_chunks.split(","))
    if len(chunks) != 3 or min(chunks) < 1:
        p.error(f"--source-chunks wants three positive sizes, got {args.source_chunks!r}")
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    try:
        src = work / "src.zarr"
        steps = make_source(src, int(parse_bytes(args.size)), chunks)
        total = (SIDE // 32) ** 2
        print(f"source: {steps} maps of {SIDE}x{SIDE} float32 = "
              f"{format_bytes(steps * SIDE * SIDE * 4)} in chunks {chunks}; "
              f"{total} target chunks")  # fmt: skip
        ratios = []
        for k in range(args.repeat):
            full = work / f"full{k}.zarr"
            whole = timed(command(src, full, args))
            cut = work / f"cut{k}.zarr"
            share = killed_at(command(src, cut, args), cut, total, args.share)
            resumed = timed(command(src, cut, args, "--resume"))
            same = np.array_equal(
                zarr.open_array(src / "t2m")[...], zarr.open_array(cut / "t2m")[...]
            )
            ratios.append(resumed / whole)
            print(
                f"[{k}] full {whole:.1f} s; killed at {share:.0%} written; "
                f"resumed in {resumed:.1f} s = {resumed / whole:.2f}x; equal: {same}"
            )
            shutil.rmtree(full)
            shutil.rmtree(cut)
        print(f"median resumed / full: {statistics.median(ratios):.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
