"""zarr on an S3-compatible object store: rechunk_zarr and the command line, s3:// to s3://.

Where it runs: the pytest process, a real S3-compatible server (moto's server mode) started as
a subprocess on localhost for the module, and a multi-process LocalCluster whose workers read
and write the store over HTTP.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import zarr

from rechunk_p2p.errors import RechunkInputError
from rechunk_p2p.integrations.zarr import rechunk_zarr
from tests.conftest import assert_clean_sync
from tests.test_cli import run_cli

from .stores import SHAPE, make_climate_group

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

T, Y, X = SHAPE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server on localhost, for the module."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.2)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def options(endpoint):
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"},
    }
    fs = s3fs.S3FileSystem(**opts)
    bucket = f"bucket-{time.monotonic_ns()}"
    fs.mkdir(bucket)
    return opts, fs, bucket


def _upload(fs, tmp_path, bucket: str) -> str:
    local = tmp_path / "src.zarr"
    make_climate_group(local, 3)
    fs.put(str(local), f"{bucket}/src.zarr", recursive=True)
    return f"s3://{bucket}/src.zarr"


def test_rechunk_zarr_s3_to_s3(p2p_client, tmp_path, options):
    opts, fs, bucket = options
    source = _upload(fs, tmp_path, bucket)
    target = f"s3://{bucket}/series.zarr"
    report = rechunk_zarr(
        source, target, {"time": -1, "lat": 5}, storage_options=opts, progress=False
    )
    assert report.statistics["runs"] >= 1
    src = zarr.open_group(source, mode="r", storage_options=opts)
    out = zarr.open_group(target, mode="r", storage_options=opts)
    assert out["temperature"].chunks == (T, 5, X)
    np.testing.assert_array_equal(out["temperature"][:], src["temperature"][:])
    np.testing.assert_array_equal(out["orography"][:], src["orography"][:])
    with pytest.raises(RechunkInputError, match="already exists"):
        rechunk_zarr(source, target, {"time": -1}, storage_options=opts)
    assert_clean_sync(p2p_client)


def test_cli_s3_to_s3(tmp_path, options):
    opts, fs, bucket = options
    source = _upload(fs, tmp_path, bucket)
    target = f"s3://{bucket}/cli.zarr"
    proc = run_cli(
        source, target, "--chunks", "time=-1,lat=5", "--storage-options", json.dumps(opts),
        "--workers", "2", "--threads-per-worker", "1", "--no-progress",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = zarr.open_group(target, mode="r", storage_options=opts)
    assert out["temperature"].chunks == (T, 5, X)
    src = zarr.open_group(source, mode="r", storage_options=opts)
    np.testing.assert_array_equal(out["temperature"][:], src["temperature"][:])


def test_an_unfinished_s3_target_is_resumed(p2p_client, tmp_path, options, monkeypatch):
    """A run that stopped before finishing (its records kept, two chunks torn and
    unrecorded) is refused as a new target and finished by resume=True."""
    opts, fs, bucket = options
    source = _upload(fs, tmp_path, bucket)
    target = f"s3://{bucket}/resumed.zarr"
    chunks = {"time": -1, "lat": 5}
    with monkeypatch.context() as m:
        m.setattr("rechunk_p2p.integrations.zarr.finish_run", lambda store: None)
        rechunk_zarr(source, target, chunks, storage_options=opts, progress=False)
    src = zarr.open_group(source, mode="r", storage_options=opts)
    names = sorted(n for n, a in src.members(max_depth=None) if isinstance(a, zarr.Array))
    done = f"{bucket}/resumed.zarr/.rechunk-p2p/done/{names.index('temperature')}"
    lost = sorted(fs.ls(done))[:2]
    for record in lost:
        chunk = f"{bucket}/resumed.zarr/temperature/c/" + record.rsplit("/", 1)[1].replace(".", "/")
        fs.pipe(chunk, fs.cat(chunk)[:5])  # torn
        fs.rm(record)

    with pytest.raises(RechunkInputError, match="unfinished rechunk_p2p run"):
        rechunk_zarr(source, target, chunks, storage_options=opts, progress=False)
    report = rechunk_zarr(source, target, chunks, storage_options=opts, resume=True, progress=False)
    assert report.chunks_written == 2 and report.chunks_resumed > 2
    out = zarr.open_group(target, mode="r", storage_options=opts)
    np.testing.assert_array_equal(out["temperature"][:], src["temperature"][:])
    assert not fs.exists(f"{bucket}/resumed.zarr/.rechunk-p2p/run.json")
    assert not fs.find(f"{bucket}/resumed.zarr/.rechunk-p2p")
