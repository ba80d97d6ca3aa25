"""Every exception the library raises derives from RechunkP2PError (read off the source).

A ``raise`` of a builtin exception class is allowed only where the error never leaves the
library; each such place is listed with the reason.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import rechunk_p2p

PACKAGE = Path(rechunk_p2p.__file__).parent

#: (module, exception) raised internally and handled inside the library.
INTERNAL = {
    ("store/files.py", "OSError"): "short reads/writes; wrapped in RechunkStorageError",
    ("store/files.py", "AssertionError"): "marks an unreachable line",
    ("store/direct.py", "OSError"): "short or refused unbuffered I/O; the disk store wraps "
    "it in RechunkStorageError",
    ("__init__.py", "AttributeError"): "a module __getattr__ must raise it",
    ("cli.py", "KeyboardInterrupt"): "SIGTERM stops the command line as Ctrl-C does; its main "
    "catches it",
    ("planning/partials.py", "IndexError"): "an index outside a chunk grid, as sequences do; "
    "the engine only asks for indices of its own plan",
}


def _builtin_raises() -> list[tuple[str, str, int]]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else None
            if name and isinstance(getattr(builtins, name, None), type):
                found.append((str(path.relative_to(PACKAGE)), name, node.lineno))
    return found


def test_every_raised_error_is_a_rechunk_p2p_error():
    leaking = [f for f in _builtin_raises() if (f[0], f[1]) not in INTERNAL]
    assert not leaking, leaking


def test_the_allowlist_is_still_needed():
    found = {(module, name) for module, name, _ in _builtin_raises()}
    assert set(INTERNAL) <= found
