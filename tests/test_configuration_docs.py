"""docs/configuration.md lists every setting of the YAML of defaults, with its default, and
says how many there are; the YAML's comments use the code's word for what moves (pieces); the
benchmark docs are current tables, not logs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = ROOT / "rechunk_p2p" / "rechunk-p2p.yaml"
DOC = ROOT / "docs" / "configuration.md"


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_setting_is_documented_with_its_default_and_counted():
    settings = _leaves(yaml.safe_load(DEFAULTS.read_text())["rechunk-p2p"])
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `([a-z.-]+)` \| `([^`]*)` \|", text, flags=re.M))
    assert set(rows) == set(settings)
    for key, default in settings.items():
        shown = "null" if default is None else str(default).lower()
        assert rows[key].lower() == shown, key
    assert f"`rechunk-p2p`: {len(settings)} settings." in text


def test_the_defaults_speak_of_pieces():
    comments = [line for line in DEFAULTS.read_text().splitlines() if "#" in line]
    assert not [line for line in comments if "shard" in line.lower()]


def test_the_benchmark_docs_state_the_present():
    # current tables, the commands that make them and what they mean; dated runs live in git
    for name in ("performance.md", "scaling.md"):
        lines = (ROOT / "docs" / name).read_text().splitlines()
        assert len(lines) <= 250, (name, len(lines))
        assert any(
            line.startswith("PYTHONPATH=. .venv/bin/python -m integration.") for line in lines
        )
