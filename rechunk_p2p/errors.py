"""The exception hierarchy of rechunk_p2p.

Where it runs: pure (it imports only distributed's ``CommClosedError``, for
:data:`BROKEN_CONNECTION`). Every error raised by the library derives from
:class:`RechunkP2PError`; those a user would catch as a builtin also derive from it
(``ValueError`` for bad input, ``TypeError`` for a wrong type, ``OSError`` for storage).
"""

from __future__ import annotations

from distributed.comm import CommClosedError


class RechunkP2PError(Exception):
    """Root of every error raised by rechunk_p2p."""


class RechunkInputError(RechunkP2PError, ValueError):
    """The input array or the requested chunks cannot be rechunked as asked."""


class RechunkTypeError(RechunkP2PError, TypeError):
    """An argument has the wrong type (for example, not a dask array)."""


class RechunkStorageError(RechunkP2PError, OSError):
    """Buffering pieces on a worker failed (for example, the local disk is full)."""


class RechunkRunError(RechunkP2PError, RuntimeError):
    """A rechunk run failed on the cluster (a worker left, a comm failed, it was cancelled)."""


class RechunkCommError(RechunkRunError):
    """Pieces could not be delivered to another worker in time (unreachable or silent peer)."""


class RechunkStalledError(RechunkRunError):
    """A rechunk's outputs waited too long for a worker that runs no tasks (paused by memory,
    or retiring): the message names the worker, its status and its memory."""


class StaleRunError(RechunkRunError):
    """A message or task belongs to a run that has since been restarted or closed."""


class OutputConsumedError(StaleRunError):
    """An output chunk was assembled before, its pieces are gone, and its result was lost: the
    rechunk has to run again (a continued run whose kept output the worker dropped)."""


class ClusterError(RechunkP2PError, RuntimeError):
    """The cluster cannot run a P2P rechunk (no client, unreachable scheduler, no workers)."""


#: A request's connection closed, aborted or refused under it: worth sending again. Not an
#: error the other side raised, which distributed re-raises with its own type (``OSError``s
#: such as ``PermissionError`` included).
BROKEN_CONNECTION = (CommClosedError, ConnectionError)
