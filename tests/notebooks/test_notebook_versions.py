"""The oldest end of the TRL / transformers window that scripts/test runs the notebook tests on is
pyproject's lower bound (the first release of it that is not yanked), and docs/training.md names both."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _lower_bounds() -> dict[str, str]:
    train = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    bounds = {}
    for line in train:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                bounds[requirement.name] = spec.version
    return bounds


def _oldest_pins() -> dict[str, str]:
    script = (ROOT / "scripts" / "test").read_text()
    pins = re.search(r'^OLDEST="([^"]+)"', script, re.M).group(1).split()
    return dict(pin.split("==") for pin in pins)


def test_the_oldest_run_pins_pyprojects_lower_bounds():
    bounds, pins = _lower_bounds(), _oldest_pins()
    for name in ("trl", "transformers"):
        assert Version(pins[name]) == Version(bounds[name]), f"scripts/test runs {name} {pins[name]}, pyproject allows >= {bounds[name]}"


def test_the_docs_name_both_ends():
    docs = (ROOT / "docs" / "training.md").read_text()
    pins = _oldest_pins()
    for name in ("TRL", "transformers"):
        assert re.search(rf"{name} {re.escape(pins[name.lower()])}\b", docs), f"docs/training.md lacks the oldest {name}"
