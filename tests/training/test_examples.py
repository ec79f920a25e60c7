"""The shipped examples (examples/): each opens with the command that runs it. Each config loads and
passes the config checks and TRL's SFTConfig, as `unsloth train` would check it before loading a model;
each script (they need the model hub, so they do not run here) compiles and finds every unsloth name it
imports."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shlex
from pathlib import Path

import pytest

from unsloth.training.config import load_config
from unsloth.training.sft import check_before_loading

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


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


def test_every_example_is_a_config_or_a_script():
    assert sorted(EXAMPLES.iterdir()) == sorted(CONFIGS + SCRIPTS) and SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_an_example_script_says_how_to_run_it(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# ") and shlex.split(first[2:]) == ["python", f"examples/{path.name}"]


@pytest.mark.slow  # imports the notebook facade (torch, transformers)
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_an_example_script_compiles_and_finds_what_it_imports_from_unsloth(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    compile(tree, str(path), "exec")
    wanted = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and (node.module or "").split(".")[0] == "unsloth" for alias in node.names]
    assert wanted
    missing = [f"{module}.{name}" for module, name in wanted if not hasattr(importlib.import_module(module), name)
               and importlib.util.find_spec(f"{module}.{name}") is None]
    assert not missing, f"{path.name} imports names unsloth does not have: {missing}"
