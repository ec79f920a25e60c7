"""The plan JSON users see (`unsloth install --dry-run --json`, docs/json.md) stays byte for byte what
it was: golden files written once by tests/plan/golden/make_golden.py, from detected fixture
platforms planned against a frozen copy of the matrix (so matrix edits do not move them)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from unsloth.matrix import load_matrix
from unsloth.plan import BitsAndBytes, FitRow, LlamaCpp, Plan, resolve
from unsloth.platform.facts import Gpu, Platform

GOLDEN = Path(__file__).resolve().parent / "golden"
DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "dumps"
# "<dump>" or "<dump>@<what the overrides pin>"
OVERRIDES = {
    "nvidia-smi__rtx4090_wsl__1@rocm-pin": {"torch_index_url": "https://download.pytorch.org/whl/rocm6.4"},
    "linux-full__7900xtx_all_probes@mirrors": {"pytorch_mirror": "https://mirror.example/whl/",
                                               "amd_mirror": "https://amd.mirror.example/rocm/whl"},
    "Get-WmiObject__gfx1036+gfx1100_windows__1@mirrors": {"amd_mirror": "https://amd.mirror.example/rocm/whl"},
}
CASES = sorted({d.name for d in DUMPS.iterdir() if d.is_dir()} | set(OVERRIDES))


def platform_from_json(data: dict) -> Platform:
    """An input written by detection; one missing a fact detection now states (written before it did)
    would silently plan with that fact unknown, so it is refused."""
    missing = {f.name for f in fields(Platform)} - set(data)
    assert not missing, f"a golden platform without {sorted(missing)}: write it again with make_golden.py"
    return Platform(**{**data, "gpus": [Gpu(**gpu) for gpu in data["gpus"]]})


def plan_text(platform_json: dict, overrides: dict | None) -> str:
    plan = resolve(platform_from_json(platform_json), load_matrix(GOLDEN / "hardware_matrix.toml"), overrides=overrides)
    return json.dumps(plan.to_json(), indent=2) + "\n"  # as commands/install.py prints it


def test_every_case_has_its_golden_files():
    missing = [case for case in CASES if not (GOLDEN / f"{case}.plan.json").is_file()]
    assert not missing, f"no golden plan for {missing}: run tests/plan/golden/make_golden.py"


@pytest.mark.parametrize("case", CASES)
def test_the_plan_json_is_byte_for_byte_the_golden_one(case):
    platform_json = json.loads((GOLDEN / f"{case}.platform.json").read_text(encoding="utf-8"))
    assert plan_text(platform_json, OVERRIDES.get(case)) == (GOLDEN / f"{case}.plan.json").read_text(encoding="utf-8")


@pytest.mark.parametrize("case", CASES)
def test_a_plan_reads_back_from_its_json(case):
    """`Plan.from_json` rebuilds the typed plan (a receipt's, or a dry run's) that prints the same JSON."""
    data = json.loads((GOLDEN / f"{case}.plan.json").read_text(encoding="utf-8"))
    plan = Plan.from_json(data)
    assert isinstance(plan.llama_cpp, LlamaCpp) and isinstance(plan.bitsandbytes, BitsAndBytes)
    assert plan.fits is None or all(isinstance(row, FitRow) for row in plan.fits.table)
    assert plan.to_json() == data
