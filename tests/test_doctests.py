"""The examples in the package's docstrings run and show what they claim."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import rechunk_p2p


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(rechunk_p2p.__path__, "rechunk_p2p."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        examples = [e for t in doctest.DocTestFinder().find(module) for e in t.examples]
        if any(not e.options.get(doctest.SKIP) for e in examples):
            names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_examples_are_found():
    assert {"rechunk_p2p.planning.plan", "rechunk_p2p.store"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
