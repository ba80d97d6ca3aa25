"""The package says it is typed, and carries its license."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def test_the_package_is_marked_typed():
    assert resources.files("rechunk_p2p").joinpath("py.typed").is_file()


def test_the_license_is_the_one_pyproject_names():
    root = Path(__file__).resolve().parent.parent
    assert 'license = { text = "BSD-3-Clause" }' in (root / "pyproject.toml").read_text()
    assert (root / "LICENSE").read_text().startswith("BSD 3-Clause License")
