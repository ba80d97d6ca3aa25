"""Where a zarr rechunk writes: the target's location, whether it held something before,
and whether that is an unfinished run of this engine (replaced by ``overwrite``, continued by
``resume``).

Where it runs: the client (the caller's thread); metadata and directory listings only,
until :meth:`Target.remove` deletes a target.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zarr
from zarr.abc.store import Store

from rechunk_p2p.errors import RechunkInputError, RechunkTypeError
from rechunk_p2p.integrations.zarr_writes import is_unfinished

_METADATA_FILES = ("zarr.json", ".zgroup", ".zarray")


def is_url(path: Any) -> bool:
    return isinstance(path, str) and "://" in path


def local_root(store: Any, path: str = "") -> str | None:
    """The directory of ``path`` inside a local store, else ``None``."""
    if isinstance(store, zarr.storage.LocalStore):
        return os.path.realpath(os.path.join(str(store.root), path))
    return None


@dataclass(frozen=True)
class Target:
    """**Immutable.** Where the target goes, whether it was there before the call, and
    whether the call continues an unfinished run there (``resume``)."""

    location: Any
    path: str | None
    existed: bool
    resume: bool = False

    @classmethod
    def of(
        cls,
        target: Any,
        root: zarr.Array | zarr.Group,
        *,
        overwrite: bool,
        resume: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> Target:
        """Check ``target`` against the source, ``overwrite`` and ``resume``; touch
        nothing."""
        if resume and overwrite:
            raise RechunkInputError(
                "resume=True and overwrite=True exclude each other: resume continues the "
                "target's unfinished run, overwrite starts over"
            )
        target = _local_or_store(target, storage_options)
        if isinstance(target, str):
            path = target
            existed = os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))
            _check_overlap(path, local_root(root.store, root.path))
            unfinished = is_unfinished(path)
            if existed and overwrite and not (unfinished or _is_zarr_dir(path)):
                raise RechunkInputError(
                    f"target {path!r} exists and is not a zarr store; refusing to delete it"
                )
            location: Any = path
        else:
            path, location = None, target
            unfinished = is_unfinished(target)
            existed = unfinished or _has_zarr_node(target)
            if target == root.store:
                raise RechunkInputError("target is the source's store; write to a new store")
        where = repr(path) if path else repr(target)
        if resume and not unfinished:
            state = "holds no unfinished rechunk_p2p run" if existed else "does not exist"
            raise RechunkInputError(
                f"nothing to resume at {where}: it {state}; drop resume=True (--resume)"
            )
        if existed and not overwrite and not resume:
            if unfinished:
                raise RechunkInputError(
                    f"target {where} holds an unfinished rechunk_p2p run; pass resume=True "
                    "(--resume) to finish it, or overwrite=True (--overwrite) to start over"
                )
            raise RechunkInputError(
                f"target {where} already exists; pass overwrite=True (--overwrite) to replace it"
            )
        return cls(location, path, existed, resume)

    def clear(self) -> None:
        """Delete what an overwritten target held (called after all checks passed)."""
        if self.existed and not self.resume:
            self.remove()

    def remove(self) -> None:
        """Delete the target (after a failure, or before overwriting it)."""
        if self.path is not None:
            if os.path.isdir(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
            elif os.path.exists(self.path):
                os.remove(self.path)
        elif isinstance(self.location, Store):
            from zarr.core.sync import sync

            sync(self.location.clear())

    def __str__(self) -> str:
        return self.path or repr(self.location)


def _local_or_store(target: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
    """A local target as its absolute path, anything else as a zarr store."""
    if isinstance(target, zarr.storage.LocalStore):
        target = str(target.root)
    elif isinstance(target, str) and target.startswith("file://"):
        target = target[len("file://") :]
    elif is_url(target):
        try:
            return zarr.storage.FsspecStore.from_url(
                target, storage_options=dict(storage_options or {}), read_only=False
            )
        except ImportError as e:
            raise RechunkInputError(f"target {target!r} is a URL, which needs fsspec: {e}") from e
    if isinstance(target, str | os.PathLike):
        return os.path.realpath(os.path.expanduser(os.fspath(target)))
    if isinstance(target, zarr.storage.MemoryStore):
        raise RechunkInputError(
            "the target is an in-memory store: workers would write to copies of it; "
            "write to a path or a store the workers share"
        )
    if not isinstance(target, Store):
        raise RechunkTypeError(
            f"target must be a path, URL or zarr store, not {type(target).__name__}"
        )
    return target


def _check_overlap(target: str, source: str | None) -> None:
    if source is None:
        return
    inside = os.path.commonpath([target, source]) in (target, source)
    if inside:
        raise RechunkInputError(
            f"target {target!r} overlaps the source {source!r}; write to a separate path"
        )


def _is_zarr_dir(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in _METADATA_FILES
    )


def _has_zarr_node(store: Any) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
            zarr.open(store, mode="r")
    except (FileNotFoundError, zarr.errors.BaseZarrError):
        return False
    return True
