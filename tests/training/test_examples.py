"""The shipped example configs (examples/): each opens with the command that runs it, and each loads,
passes the config checks and TRL's SFTConfig, as `unsloth train` would check it before loading a model."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from unsloth.training.config import load_config
from unsloth.training.sft import check_before_loading

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))


def test_there_are_examples_in_each_format():
    assert {p.suffix for p in CONFIGS} >= {".toml", ".yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_an_example_says_how_to_run_it(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# "), f"{path.name}: the first line must be a comment with its run command"
    assert shlex.split(first[2:]) == ["unsloth", "train", f"examples/{path.name}"]


@pytest.mark.slow  # imports TRL
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_an_example_loads_and_passes_the_checks(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative output_dir / dataset paths resolve here, as from a project folder
    config = load_config(path)
    check_before_loading(config)
    assert config.output_dir.startswith("outputs/") and config.model.name and config.dataset.name
