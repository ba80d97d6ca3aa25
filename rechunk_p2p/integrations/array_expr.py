"""The P2P rechunk as an expression of dask's array query planning (``array.query-planning``).

Where it runs: the client (expression construction, optimisation and lowering to tasks).

Imported only when dask.array runs with query planning on. :class:`P2PRechunk` lowers to the
same tasks as the classic graph (:class:`rechunk_p2p.graph.RechunkLayer`). A basic slice of
its output is pushed into it while optimising: the expression then builds only the output
chunks the slice reads, so the shuffle moves only their pieces (as culling does in the classic
graph).
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from itertools import product
from typing import Any

from dask.array._array_expr._expr import ArrayExpr
from dask.array._array_expr._slicing import SliceSlicesIntegers
from dask.array.slicing import _slice_1d

from rechunk_p2p.graph import RechunkLayer
from rechunk_p2p.spec import OUTPUT_PREFIX


class P2PRechunk(ArrayExpr):
    """**Immutable.** ``array`` rechunked through the engine's P2P shuffle.

    Operands: the input expression, the plan, the rechunk's token, the storage setting, the
    output chunks, the axes of unknown chunk sizes, and the output chunks to build (global
    indices; ``None``: all).
    """

    _parameters = ["array", "plan", "token", "storage", "new_chunks", "unknown_axes", "keep"]
    _defaults = {"unknown_axes": (), "keep": None}

    @property
    def _meta(self) -> Any:
        return self.array._meta

    @cached_property
    def chunks(self) -> tuple[tuple[float, ...], ...]:
        return self.operand("new_chunks")

    @cached_property
    def _name(self) -> str:
        name = OUTPUT_PREFIX + self.token
        if self.keep is not None:
            digest = hashlib.sha1(repr(sorted(self.keep)).encode(), usedforsecurity=False)
            name += "-" + digest.hexdigest()[:12]
        return name

    def _layer(self) -> dict:
        layer = RechunkLayer(
            self._name,
            self.array.name,
            self.plan,
            self.token,
            self.storage,
            tuple(self.unknown_axes),
            self.keep,
        )
        return dict(layer)

    def _simplify_up(self, parent: Any, dependents: Any) -> Any:
        """Build only the chunks a basic slice reads, when the slice is the only reader."""
        if not isinstance(parent, SliceSlicesIntegers) or self.keep is not None:
            return None
        if len(dependents.get(self._name, ())) > 1:
            return None
        blocks = [
            sorted(_slice_1d(n, c, i)) for n, c, i in zip(self.shape, self.chunks, parent.index)
        ]
        keep = frozenset(product(*blocks))
        if len(keep) == self.plan.n_output_chunks:
            return None
        culled = P2PRechunk(*self.operands[:-1], keep)
        return type(parent)(culled, *parent.operands[1:])


def p2p_rechunk_expr(
    x: Any,
    plan: Any,
    token: str,
    storage: str,
    new_chunks: Any,
    unknown_axes: tuple[int, ...],
) -> Any:
    """The array (an expression collection) that is ``x`` rechunked through the engine."""
    from dask.array._array_expr._collection import new_collection

    expr = P2PRechunk(x.expr, plan, token, storage, new_chunks, unknown_axes)
    return new_collection(expr)
