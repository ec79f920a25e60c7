"""Every fixture dump in tests/fixtures/dumps: detect's JSON must satisfy its expect.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from unsloth.platform.detect import detect_from_dump

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DUMPS = sorted(p for p in (FIXTURES / "dumps").iterdir() if (p / "expect.json").is_file())

_spec = importlib.util.spec_from_file_location("expect_compare", FIXTURES / "expect_compare.py")
expect_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(expect_compare)


def test_there_are_many_dumps():
    assert len(DUMPS) >= 30


@pytest.mark.parametrize("dump", DUMPS, ids=[p.name for p in DUMPS])
def test_detect_matches_expectation(dump: Path):
    expected = json.loads((dump / "expect.json").read_text())["detect"]
    platform, _ = detect_from_dump(dump)
    detected = json.loads(json.dumps(platform.to_json()))  # exactly what `detect --json` prints
    assert expect_compare.compare_detect(expected, detected) == [], platform.notes
