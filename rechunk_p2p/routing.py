"""Opt-in routing of dask's P2P rechunks through this engine.

Where it runs: the client (it swaps the ``rechunk`` function of the ``dask.array.rechunk`` module,
which ``Array.rechunk`` imports on every call, and ``dask.array.rechunk``, the same function
re-exported by the ``dask.array`` package).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_lock = threading.Lock()
#: ``(module, the rechunk install() replaced, its replacement)`` while installed
_swapped: list[tuple[Any, Callable[..., Any], Callable[..., Any]]] = []


def _module() -> Any:
    import dask.array.rechunk  # noqa: F401  (ensure the module is imported)

    return sys.modules["dask.array.rechunk"]


def _targets() -> list[Any]:
    """The modules whose ``rechunk`` dask calls: the classic one, and with array query
    planning the expression collection's (``Array.rechunk`` looks it up there)."""
    import dask.array as da

    modules = [_module()]
    if da.Array.__module__.startswith("dask.array._array_expr"):
        modules.append(sys.modules[da.Array.__module__])
    return modules


def _runs_as_p2p(
    x: Any, chunks: Any, threshold: Any, block_size_limit: Any, balance: bool, method: Any
) -> bool:
    """Whether dask would rechunk as P2P: the argument, else the config, else dask's own
    heuristic (P2P when a distributed client exists and the tasks graph would be large)."""
    import dask

    chosen = method or dask.config.get("array.rechunk.method", None)
    if chosen is not None:
        return chosen == "p2p"
    from rechunk_p2p.arrays import normalize

    try:
        new = normalize(x, chunks, block_size_limit=block_size_limit, balance=balance)
    except Exception:
        return False  # dask's own rechunk reports the problem in its own words
    if len(new) != x.ndim or new == x.chunks:
        return False
    return _module()._choose_rechunk_method(x.chunks, new, threshold=threshold) == "p2p"


def _router(original: Callable[..., Any]) -> Callable[..., Any]:
    """dask's ``rechunk`` (``original``), with what dask would run as P2P sent here."""

    def rechunk(
        x: Any,
        chunks: Any = "auto",
        threshold: Any = None,
        block_size_limit: Any = None,
        balance: bool = False,
        method: str | None = None,
    ) -> Any:
        if _runs_as_p2p(x, chunks, threshold, block_size_limit, balance, method):
            from rechunk_p2p.arrays import rechunk_array as engine

            return engine(x, chunks, block_size_limit=block_size_limit, balance=balance)
        return original(x, chunks, threshold, block_size_limit, balance, method)

    rechunk.__doc__ = original.__doc__
    rechunk.__wrapped__ = original  # type: ignore[attr-defined]
    return rechunk


def install() -> None:
    """Route every rechunk that dask would run as P2P here.

    That is ``x.rechunk(..., method="p2p")``, ``array.rechunk.method: p2p``, and dask's own
    choice when neither is set (P2P with a distributed client and a large all-to-all
    rechunk), hence xarray's ``.chunk()`` on dask-backed data. Idempotent. Undo with
    :func:`uninstall`.
    """
    with _lock:
        if _swapped:
            return
        package: Any = importlib.import_module("dask.array")  # (not imported by this package)
        for module in _targets():
            original: Callable[..., Any] = module.rechunk
            router = _router(original)
            _swapped.append((module, original, router))
            module.rechunk = router
            if getattr(package, "rechunk", None) is original:  # da.rechunk(x, ...)
                _swapped.append((package, original, router))
                package.rechunk = router


def uninstall() -> None:
    """Restore exactly the ``rechunk`` functions that :func:`install` replaced. Idempotent."""
    with _lock:
        while _swapped:
            module, original, router = _swapped.pop()
            if getattr(module, "rechunk", None) is router:
                module.rechunk = original


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_swapped)


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
