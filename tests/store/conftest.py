"""Fixtures for the piece-store tests: stores of both kinds, closed and checked at the end."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rechunk_p2p.store import PieceStore, make_store

#: "disk-buffered": a disk store that gathers pieces in a small write buffer (flushed every
#: few writes, and before reads), ordered by output; "disk-direct...": the same two with the
#: data file written and read unbuffered (O_DIRECT)
KINDS = ("memory", "disk", "disk-buffered", "disk-direct", "disk-direct-buffered")
BUFFERED_BYTES = 100

MakeStore = Callable[..., PieceStore]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def spill_dir(tmp_path: Path) -> Path:
    """A not-yet-existing parent directory for disk stores (created on the first write)."""
    return tmp_path / "local-dir" / "spill"


@pytest.fixture
def make(kind: str, spill_dir: Path) -> Iterator[MakeStore]:
    """Factory of stores of the parametrised kind; closes them all and checks no files remain."""
    stores: list[PieceStore] = []

    def factory(dtype: object = "f8", name: str = "rechunk-abc-run-1-sub-0") -> PieceStore:
        store = make_store(
            "disk" if kind.startswith("disk") else kind,  # type: ignore[arg-type]
            dtype=np.dtype(dtype),
            directory=spill_dir,
            name=name,
            buffer_bytes=BUFFERED_BYTES if kind.endswith("-buffered") else 0,
            direct_io="direct" in kind,
        )
        stores.append(store)
        return store

    yield factory
    for store in stores:
        if "direct" in kind and store.path is not None:  # O_DIRECT is what was tested
            assert store._file.direct is not None, "the file system refused O_DIRECT"
        store.close_blocking()
    assert not spill_dir.exists(), os.listdir(spill_dir)
    assert not spill_dir.parent.exists()
