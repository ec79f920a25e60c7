"""`unsloth install --dry-run [--json] [--from DIR]`: the plan, and nothing else happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
DUMPS = sorted(p for p in FIXTURES.iterdir() if (p / "expect.json").is_file())


def unsloth(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "UNSLOTH_HOME": str(home / "unsloth"), "HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "unsloth.cli", *args], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("dump", DUMPS, ids=[d.name for d in DUMPS])
def test_the_plan_for_a_dump_is_what_its_expectation_says(dump, tmp_path):
    done = unsloth("install", "--dry-run", "--json", "--from", str(dump), home=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    expected = json.loads((dump / "expect.json").read_text())["plan"]
    assert plan["support"] == expected["support"]
    assert plan["torch"]["backend"] == expected["torch_backend"]
    for name, value in expected.get("env", {}).items():
        assert plan["env"].get(name) == value  # None: must not be set
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_the_readable_plan_names_every_choice(tmp_path):
    done = unsloth("install", "--dry-run", "--from", str(FIXTURES / "nvidia-smi__rtx4090_wsl__1"), home=tmp_path)
    assert done.returncode == 0, done.stderr
    for row in ("support", "device", "torch", "bitsandbytes", "llama.cpp", "attention"):
        assert any(line.startswith(row) for line in done.stdout.splitlines()), row
    assert "cuda" in done.stdout and "RTX 4090" in done.stdout


def test_a_real_install_from_a_dump_is_refused(tmp_path):
    done = unsloth("install", "--yes", "--from", str(FIXTURES / "nvidia-smi__rtx4090_wsl__1"), home=tmp_path)
    assert done.returncode == 2 and "--dry-run" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_bad_input_says_what_and_how(tmp_path):
    missing = unsloth("install", "--dry-run", "--from", str(tmp_path / "nope"), home=tmp_path)
    assert missing.returncode == 2 and "not a dump directory" in missing.stderr
    unknown = unsloth("install", "--yes", "--without", "gpu", home=tmp_path)
    assert unknown.returncode == 2 and "--without gpu: not an optional part" in unknown.stderr


def test_json_without_dry_run_is_refused_before_any_build(tmp_path):
    done = unsloth("install", "--json", home=tmp_path)
    assert done.returncode == 2 and "add --dry-run" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_missing_source_is_refused_before_any_build(tmp_path):
    done = unsloth("install", "--yes", "--source", str(tmp_path / "no-such-checkout"), home=tmp_path)
    assert done.returncode == 2 and "no such file or folder" in done.stderr
    assert list(tmp_path.iterdir()) == []
