"""rechunk_zarr without a client: it starts a LocalCluster for the call and closes it."""

from __future__ import annotations

import asyncio
import threading

import distributed
import numpy as np
import pytest
import zarr

from rechunk_p2p.integrations.zarr import rechunk_zarr


def test_without_client_runs_on_its_own_local_cluster(tmp_path):
    with pytest.raises(ValueError):
        distributed.get_client()  # no client: rechunk_zarr must bring its own cluster
    data = np.arange(40 * 6, dtype="float64").reshape(40, 6)
    arr = zarr.create_array(
        tmp_path / "src.zarr",
        shape=data.shape,
        chunks=(1, 6),
        dtype=data.dtype,
        dimension_names=("time", "x"),
    )
    arr[:] = data

    report = rechunk_zarr(arr, tmp_path / "tgt.zarr", {"time": -1, "x": 2}, progress=False)

    out = zarr.open_array(tmp_path / "tgt.zarr", mode="r")
    assert tuple(out.chunks) == (40, 2)
    np.testing.assert_array_equal(out[:], data)
    assert report.statistics["runs"] >= 1
    with pytest.raises(ValueError):
        distributed.get_client()  # the cluster was closed with its client


_SCRIPT = """
import numpy as np
import zarr
from rechunk_p2p import rechunk_zarr

a = zarr.create_array("src.zarr", shape=(20, 10), chunks=(1, 10), dtype="f4")
a[:] = np.arange(200, dtype="f4").reshape(20, 10)
{call}
"""


def test_script_without_main_guard_gets_one_clear_error(tmp_path):
    """At a script's top level, with no client, rechunk_zarr says what to do (its worker
    processes would re-run the script), before anything is written."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text(_SCRIPT.format(call='rechunk_zarr("src.zarr", "dst.zarr", (20, 2))'))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "noguard.py line 8" in last and 'if __name__ == "__main__":' in last
    assert len(proc.stderr.splitlines()) < 20 and "Nanny" not in proc.stderr
    assert not (tmp_path / "dst.zarr").exists()


def test_client_given_by_address_and_unreachable_scheduler(tmp_path):
    import numpy as np
    import zarr
    from distributed import LocalCluster

    from rechunk_p2p import ClusterError, rechunk_zarr

    src = zarr.create_array(tmp_path / "s.zarr", shape=(20, 10), chunks=(1, 10), dtype="f4")
    src[:] = np.arange(200, dtype="f4").reshape(20, 10)
    with pytest.raises(ClusterError, match=r"Cannot reach the scheduler at tcp://127\.0\.0\.1:9"):
        rechunk_zarr(tmp_path / "s.zarr", tmp_path / "x.zarr", (20, 2), client="tcp://127.0.0.1:9")
    assert not (tmp_path / "x.zarr").exists()
    with LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster:
        rechunk_zarr(
            tmp_path / "s.zarr", tmp_path / "d.zarr", (20, 2), client=cluster.scheduler_address
        )
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "d.zarr")[:], src[:])


def test_an_address_that_is_not_a_schedulers_is_told_within_the_timeout():
    """Refused at once; a listener that sends nothing (a dashboard's HTTP port) within the
    timeout; one that sends what no dask server sends, at once; a real scheduler passes."""
    import socket
    import time

    from distributed import Scheduler

    from rechunk_p2p.integrations.local_client import scheduler_problem

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        start = time.monotonic()
        assert "sent nothing within 0.5 s" in scheduler_problem(address, 0.5)
        assert time.monotonic() - start < 5
    assert "connection refused" in scheduler_problem(address, 5.0)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        talker = threading.Thread(
            target=lambda: listening.accept()[0].sendall(b"HTTP/1.1 400 Bad Request\r\n")
        )
        talker.start()
        assert "answered b'HTTP/1.1'" in scheduler_problem(address, 5.0)
        talker.join()
    assert scheduler_problem("inproc://127.0.0.1/1/2", 1.0) is None  # not TCP: the client decides
    assert scheduler_problem("tcp://not a host:x", 1.0) is None  # malformed: the client says so

    async def real() -> str | None:
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            return await asyncio.to_thread(scheduler_problem, s.address, 5.0)

    assert asyncio.run(real()) is None
