"""A spill disk that fills up, for real: workers whose local directory is a small tmpfs.

The rechunk fails with one line that names the problem (an ``OSError``, ``ENOSPC``), and
nothing of the engine stays on the disk. Needs root to mount the tmpfs (CI runs as root);
skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import time

import dask
import dask.array as da
import pytest

import rechunk_p2p
from rechunk_p2p.errors import RechunkStorageError
from rechunk_p2p.store.files import ENGINE_DIRECTORY
from tests.cli_processes import cli_env, start_scheduler, start_worker, stop

#: the tmpfs: far less than the 128 MiB the workers spill between them
TMPFS_BYTES = 16 * 2**20


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _engine_files(root) -> list[str]:
    return [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        if ENGINE_DIRECTORY in d.split(os.sep)
        for f in files
    ]


def test_a_full_spill_disk_fails_in_one_line_and_leaves_nothing(small_disk, tmp_path):
    from distributed import Client

    env = cli_env()
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler = start_scheduler(scheduler_file, env)
    workers = [start_worker(scheduler_file, str(small_disk / f"w{i}"), env) for i in range(2)]
    try:
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            x = da.random.default_rng(0).random((4096, 4096), chunks=(64, 4096))  # 128 MiB
            with dask.config.set({"rechunk-p2p.storage": "disk"}):  # (read on the client)
                y = rechunk_p2p.rechunk(x, (4096, 64))
            with pytest.raises(OSError) as info:
                client.compute(y.sum(), sync=True)
            message = str(info.value)
            assert isinstance(info.value, RechunkStorageError), repr(info.value)
            assert "\n" not in message and "Free space" in message, message
            deadline = time.monotonic() + 60
            while _engine_files(small_disk) and time.monotonic() < deadline:
                time.sleep(0.2)  # the runs close on the workers, removing their files
            assert not _engine_files(small_disk)
            assert client.run_on_scheduler(
                lambda dask_scheduler: not dask_scheduler.plugins["rechunk-p2p"].active
            )
    finally:
        for process in [*workers, scheduler]:
            stop(process)
