"""The client side imports no worker code: building, planning and routing a rechunk, and the
scheduler plugin that ``register`` pickles, load neither the worker plugin, its run state, the
data plane nor the piece buffers (they load on the workers, where tasks need them)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import rechunk_p2p

_CLIENT = """
import sys
import dask.array as da
import rechunk_p2p
import rechunk_p2p.scheduler  # what register() sends to the scheduler

x = da.ones((20, 20), chunks=(1, 20))
y = rechunk_p2p.rechunk(x, (20, 1))
rechunk_p2p.plan(x, (20, 1))
rechunk_p2p.install()
x.rechunk((20, 1), method="p2p")
rechunk_p2p.uninstall()
y.compute(scheduler="sync")  # the tasks without a cluster
print(sorted(m for m in sys.modules if m.startswith("rechunk_p2p.")))
"""


def test_client_side_imports_no_worker_code():
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert {"rechunk_p2p.api", "rechunk_p2p.graph", "rechunk_p2p.tasks"} <= set(loaded)
    worker_side = [m for m in loaded if m.startswith(("rechunk_p2p.worker", "rechunk_p2p.store"))]
    assert not worker_side, worker_side


def _imports_of(path: pathlib.Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere (top level or in functions)."""
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # ``if TYPE_CHECKING:`` imports never run
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [  # ``from package import submodule`` imports the submodule only
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name != "rechunk_p2p":
                found.add(name)
    return found


def _import_graph() -> dict[str, set[str]]:
    root = pathlib.Path(rechunk_p2p.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths[name] = path
    modules = set(paths)
    return {m: _imports_of(p, m, modules) for m, p in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    """Dependencies point one way, lazy (in-function) imports included; a package's
    ``__init__`` counts as importing what it re-exports, never as imported by its parts."""
    graph = _import_graph()
    assert {"rechunk_p2p.api", "rechunk_p2p.arrays", "rechunk_p2p.worker.plugin"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


_ABOVE_ALL = (
    "rechunk_p2p.worker",
    "rechunk_p2p.scheduler",
    "rechunk_p2p.recovery",
    "rechunk_p2p.waves",
    "rechunk_p2p.diagnostics",
    "rechunk_p2p.integrations",
    "rechunk_p2p.api",
    "rechunk_p2p.cli",
)
#: package -> what it must not import: the layers below the worker import nothing above
#: them, and nothing of each other but the wire format (stores hold what the wire carries)
_MUST_NOT_IMPORT = {
    "rechunk_p2p.planning": (
        "rechunk_p2p.store",
        "rechunk_p2p.transport",
        "rechunk_p2p.cutting",
        *_ABOVE_ALL,
    ),
    "rechunk_p2p.transport": ("rechunk_p2p.store", "rechunk_p2p.cutting", *_ABOVE_ALL),
    "rechunk_p2p.store": (
        "rechunk_p2p.cutting",
        "rechunk_p2p.transport.comm",
        "rechunk_p2p.transport.limiter",
        "rechunk_p2p.transport.dataplane",
        *_ABOVE_ALL,
    ),
    "rechunk_p2p.cutting": (
        "rechunk_p2p.store",
        "rechunk_p2p.transport.comm",
        "rechunk_p2p.transport.limiter",
        "rechunk_p2p.transport.dataplane",
        *_ABOVE_ALL,
    ),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_lower_layers_import_nothing_from_higher_ones():
    graph = _import_graph()
    assert {"rechunk_p2p.store.base", "rechunk_p2p.transport.wire"} <= set(graph)
    wrong = sorted(
        f"{module} -> {imported}"
        for module, imports in graph.items()
        for package, banned in _MUST_NOT_IMPORT.items()
        if _within(module, package)
        for imported in imports
        if any(_within(imported, b) for b in banned)
    )
    assert not wrong, wrong


def test_the_layer_check_sees_a_wrong_import():
    graph = {"rechunk_p2p.store.base": {"rechunk_p2p.worker.run"}}
    wrong = [
        (m, i)
        for m, imports in graph.items()
        for package, banned in _MUST_NOT_IMPORT.items()
        if _within(m, package)
        for i in imports
        if any(_within(i, b) for b in banned)
    ]
    assert wrong == [("rechunk_p2p.store.base", "rechunk_p2p.worker.run")]


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
