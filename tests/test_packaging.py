"""The package says it is typed, carries its license, has its version in one place, and its
pre-commit hooks run ruff and the type check."""

from __future__ import annotations

from importlib import metadata, resources
from pathlib import Path

import pytest
import yaml

import rechunk_p2p

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_is_marked_typed():
    assert resources.files("rechunk_p2p").joinpath("py.typed").is_file()


def test_the_license_is_the_one_pyproject_names():
    root = Path(__file__).resolve().parent.parent
    assert 'license = { text = "BSD-3-Clause" }' in (root / "pyproject.toml").read_text()
    assert (root / "LICENSE").read_text().startswith("BSD 3-Clause License")


def test_the_version_is_written_once():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert metadata.version("rechunk_p2p") == rechunk_p2p.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = [line for line in changelog.splitlines() if line.startswith("## ")]
    assert any(rechunk_p2p.__version__ in line for line in headings), headings


def test_pre_commit_runs_ruff_and_the_type_check():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = [hook["entry"] for repo in config["repos"] for hook in repo["hooks"]]
    assert "ruff check --fix" in entries and "ruff format" in entries
    assert "mypy" in entries  # over the package, as pyproject.toml configures it
