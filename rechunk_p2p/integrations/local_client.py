"""The client a zarr rechunk runs on: the one given, the current one, or a local cluster.

Where it runs: the client (the caller's thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import distributed

from rechunk_p2p.errors import ClusterError


@contextlib.contextmanager
def client_for(given: distributed.Client | str | None = None) -> Iterator[distributed.Client]:
    """``given`` (a client, or a scheduler's address to connect to), else the current client,
    else a LocalCluster sized to the machine for the block."""
    if isinstance(given, distributed.Client):
        yield given
        return
    if isinstance(given, str):
        problem = scheduler_problem(given, timeout=10.0)
        if problem is not None:  # no point in retrying, or in reading garbage
            raise ClusterError(f"Cannot reach the scheduler at {given}: {problem}")
        try:
            connected = distributed.Client(given, timeout="10s")
        except (OSError, TimeoutError) as e:
            raise ClusterError(f"Cannot reach the scheduler at {given}: {e}") from None
        with connected:
            yield connected
        return
    try:
        client = distributed.get_client()
    except ValueError:
        client = None
    if client is not None:
        yield client
        return
    _require_main_guard()
    with workers_ignore_interrupts():
        cluster = distributed.LocalCluster(dashboard_address=":0")
    with cluster, distributed.Client(cluster) as client:
        yield client


@contextlib.contextmanager
def workers_ignore_interrupts() -> Iterator[None]:
    """Worker processes started in the block ignore SIGINT (they inherit an ignored signal).

    Ctrl-C in a terminal signals every process of the foreground group: the workers of a
    local cluster would die at once (a traceback each) with chunks half written. Ignoring it
    there leaves the interrupt to the caller, which stops the run, waits for the writes in
    progress and closes the cluster in order. Only in the main thread (where signals are
    handled); the caller's own handler is restored on leaving.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


#: A dask server's first message, the handshake, is a few hundred bytes: the first 8 bytes
#: it sends (a little-endian count of the bytes that follow) are far below this. An HTTP
#: server's answer read so ("HTTP/1.1") is 3 EiB, which distributed tried to allocate.
_HANDSHAKE_BYTES = 2**20


def scheduler_problem(address: str, timeout: float) -> str | None:
    """Why ``address`` is not a dask scheduler's, found before a client connects, or ``None``
    (it sent what a dask server sends first, or the address is not plain TCP: then
    distributed's client decides).

    A dask server sends its handshake as soon as it accepts a connection. Nothing listening,
    nothing sent within ``timeout`` seconds (a dashboard's HTTP port waits for a request), or
    bytes that cannot start a dask message are each told in one line, within ``timeout``:
    distributed's client would wait past its own timeout for the first, and fail with a
    17-frame traceback on the last.
    """
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme != "tcp":
            return None
        host, port = parse_host_port(location)
    except (ValueError, TypeError):
        return None  # malformed: the client says so
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            first = _read_exactly(sock, 8)
    except ConnectionRefusedError as e:
        return f"connection refused ({e.strerror or e})"
    except TimeoutError:
        return (
            f"it sent nothing within {timeout:g} s, as a dask scheduler does at once "
            "(is it the scheduler's address, not its dashboard's?)"
        )
    except OSError as e:
        return f"{e.strerror or e}"
    if len(first) < 8 or int.from_bytes(first, "little") > _HANDSHAKE_BYTES:
        return f"it answered {first[:8]!r}, not as a dask scheduler does"
    return None


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes from ``sock`` (fewer if it closes first)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _require_main_guard() -> None:
    """Refuse to start worker processes from a script's unguarded top level.

    The worker processes of a LocalCluster re-run the main script from the top; a call at
    its top level would start clusters without end (hundreds of lines of errors). The call
    is found in the stack and the script's source tells whether it sits under
    ``if __name__ == "__main__":``.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
    ):
        frame = frame.f_back
    if frame is None or path is None or frame.f_code.co_filename != path:
        return
    if not _is_guarded(path, frame.f_lineno):
        raise ClusterError(
            f"{os.path.basename(path)} line {frame.f_lineno}: rechunk_zarr starts a local "
            "cluster whose worker processes re-run this script from the top; put the call "
            'under `if __name__ == "__main__":`, or pass client= (a Client or an address)'
        )


def _is_guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script at ``path`` is inside ``if __name__ == "__main__":``."""
    import ast

    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: let it run
    return any(
        isinstance(node, ast.If)
        and "__main__" in ast.unparse(node.test)
        and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        for node in ast.walk(tree)
    )
