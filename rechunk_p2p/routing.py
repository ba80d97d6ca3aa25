"""Opt-in routing of dask's P2P rechunks through this engine.

Where it runs: the client (it swaps the ``rechunk`` function of the ``dask.array.rechunk`` module,
which ``Array.rechunk`` imports on every call, and ``dask.array.rechunk``, the same function
re-exported by the ``dask.array`` package).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_lock = threading.Lock()
_original: Callable[..., Any] | None = None


def _module() -> Any:
    import dask.array.rechunk  # noqa: F401  (ensure the module is imported)

    return sys.modules["dask.array.rechunk"]


def _runs_as_p2p(
    x: Any, chunks: Any, threshold: Any, block_size_limit: Any, balance: bool, method: Any
) -> bool:
    """Whether dask would rechunk as P2P: the argument, else the config, else dask's own
    heuristic (P2P when a distributed client exists and the tasks graph would be large)."""
    import dask

    chosen = method or dask.config.get("array.rechunk.method", None)
    if chosen is not None:
        return chosen == "p2p"
    from rechunk_p2p.api import normalize

    try:
        new = normalize(x, chunks, block_size_limit=block_size_limit, balance=balance)
    except Exception:
        return False  # dask's own rechunk reports the problem in its own words
    if len(new) != x.ndim or new == x.chunks:
        return False
    return _module()._choose_rechunk_method(x.chunks, new, threshold=threshold) == "p2p"


def _routed_rechunk(
    x: Any,
    chunks: Any = "auto",
    threshold: Any = None,
    block_size_limit: Any = None,
    balance: bool = False,
    method: str | None = None,
) -> Any:
    """dask's ``rechunk``, with every rechunk that dask would run as P2P sent to rechunk_p2p."""
    assert _original is not None
    if _runs_as_p2p(x, chunks, threshold, block_size_limit, balance, method):
        from rechunk_p2p.api import rechunk

        return rechunk(
            x, chunks, threshold=threshold, block_size_limit=block_size_limit, balance=balance
        )
    return _original(x, chunks, threshold, block_size_limit, balance, method)


def install() -> None:
    """Route every rechunk that dask would run as P2P here.

    That is ``x.rechunk(..., method="p2p")``, ``array.rechunk.method: p2p``, and dask's own
    choice when neither is set (P2P with a distributed client and a large all-to-all
    rechunk), hence xarray's ``.chunk()`` on dask-backed data. Idempotent. Undo with
    :func:`uninstall`.
    """
    global _original
    with _lock:
        module = _module()
        if _original is not None:
            return
        _original = module.rechunk
        module.rechunk = _routed_rechunk
        package = sys.modules["dask.array"]
        if getattr(package, "rechunk", None) is _original:  # da.rechunk(x, ...)
            package.rechunk = _routed_rechunk


def uninstall() -> None:
    """Restore exactly the ``rechunk`` that :func:`install` replaced. Idempotent."""
    global _original
    with _lock:
        if _original is None:
            return
        _module().rechunk = _original
        package = sys.modules["dask.array"]
        if getattr(package, "rechunk", None) is _routed_rechunk:
            package.rechunk = _original
        _original = None


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _original is not None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Route P2P rechunks here inside the block; restore what was there after it."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
