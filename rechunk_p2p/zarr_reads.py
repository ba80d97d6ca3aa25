"""Reading a box of a zarr array's chunks in one call through zarrs' codec pipeline.

Where it runs: worker task threads (a transfer task reading its joined input); nothing here
runs on an event loop.

zarr-python reads a chunk through a chain of asyncio tasks and two thread hand-offs (the
store's read, the codec's decode): about 0.3-0.5 ms a chunk whatever its size, so a transfer
reading a thousand 2 KiB chunks of an hourly ERA5 store spends its time there, not in bytes.
zarrs (``pip install zarrs``, the zarr-python codec pipeline written in Rust that the zarr
project lists) reads and decodes a request's chunks in its own threads at about a tenth of
that. Where it is installed and supports the array's store and codecs, a joined read goes
through an array object on zarrs' pipeline over the same store; anything else (another array
type, a store zarrs cannot read, zarrs absent) reads as dask's ``getter`` would, unchanged.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from dask.array.core import getter

#: The zarr config path of zarrs' codec pipeline
ZARRS_PIPELINE = "zarrs.ZarrsCodecPipeline"

#: ``id(source) -> (weak reference to source, the array to read it with)``; an entry whose
#: source is gone is dropped on the next miss
_READERS: dict[int, tuple[weakref.ref, Any]] = {}
#: Guards :data:`_READERS` and the zarr config while a reader is built (``config.set`` is
#: process-wide: two builders at once could restore each other's settings out of order)
_LOCK = threading.Lock()


def read_box_blocking(source: Any, box: Any, asarray: bool = True, lock: Any = None) -> Any:
    """Task body: ``getter(source, box)`` of dask, through zarrs' pipeline where ``source``
    is a zarr array it can read (see :func:`reader_for`)."""
    return getter(reader_for(source), box, asarray=asarray, lock=lock)


def reader_for(source: Any) -> Any:
    """The array to read ``source`` with: for a zarr array whose store and codecs zarrs
    reads, the same array on zarrs' codec pipeline (made once a process and kept while
    ``source`` lives); else ``source`` itself."""
    with _LOCK:
        hit = _READERS.get(id(source))
        if hit is not None and hit[0]() is source:
            return hit[1]
        try:
            ref = weakref.ref(source)
        except TypeError:  # (an object that takes no weak reference: read as it is)
            return source
        reader = _zarrs_array(source)
        for key in [k for k, (r, _) in _READERS.items() if r() is None]:
            del _READERS[key]
        _READERS[id(source)] = (ref, reader)
        return reader


def _zarrs_array(source: Any) -> Any:
    """``source`` on zarrs' pipeline, or ``source`` where that cannot be (called under
    :data:`_LOCK`)."""
    try:
        import zarr
        import zarrs  # noqa: F401  (the pipeline's module must import)
    except ImportError:
        return source
    if not isinstance(source, zarr.Array):
        return source
    inner = source.async_array
    store = _local_store(inner.store_path.store)
    with zarr.config.set({"codec_pipeline.path": ZARRS_PIPELINE}):
        fast = zarr.Array(
            zarr.AsyncArray(
                metadata=inner.metadata,
                store_path=zarr.storage.StorePath(store, inner.store_path.path),
                config=inner.config,
            )
        )
    pipeline = fast.async_array.codec_pipeline
    on_zarrs = type(pipeline).__module__.split(".")[0] == "zarrs"
    if not on_zarrs or getattr(pipeline, "impl", None) is None:
        return source  # zarrs cannot read this store or these codecs itself
    return fast


def _local_store(store: Any) -> Any:
    """A local directory behind an fsspec store (what ``da.from_zarr(path)`` opens) as
    zarr's own local store, which zarrs reads; any other store as it is."""
    from zarr.storage import FsspecStore, LocalStore

    if not isinstance(store, FsspecStore):
        return store
    fs = getattr(store.fs, "sync_fs", store.fs)  # (fsspec's async wrapper of a sync one)
    if "file" not in _protocols(fs):
        return store
    return LocalStore(store.path, read_only=True)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
