"""Real tool outputs (tests/fixtures/dumps) through detection and the planner, end to end.

Dumps whose expect.json carries a "plan" section are checked with the shared comparator; for the
others this file states what the plan must be (support, torch backend and variant, env)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from unsloth.plan import resolve
from unsloth.platform.detect import detect_from_dump

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "dumps"
_spec = importlib.util.spec_from_file_location("expect_compare", DUMPS.parent / "expect_compare.py")
expect_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(expect_compare)

WITH_PLAN = sorted(
    d.name
    for d in DUMPS.iterdir()
    if (d / "expect.json").is_file() and "plan" in json.loads((d / "expect.json").read_text())
)

# dump -> (support, torch backend, torch variant, env the plan sets, a phrase a warning must contain)
OURS = {
    "rocminfo__gfx1031_rx6700xt": ("limited", "rocm", "rocm7.2", {"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}, None),
    "apu__gfx1103_780m_no_dgpu": ("full", "rocm", "rocm7.2", {"HSA_OVERRIDE_GFX_VERSION": "11.0.0"}, None),
    "lspci__navi31__1": ("full", "rocm", "rocm7.2", {}, "ROCm was not found"),  # lspci only: no ROCm tool ran
    "strix-halo__hsa_override_spoof": ("full", "rocm", "rocm7.2", {}, "instead of the real gfx1151"),
    "strix-halo__spoof_without_env": ("full", "rocm", "rocm7.2", {}, "reports gfx1100 for the real gfx1151"),
    "rocminfo__multi_radeon_with_cpu": ("full", "rocm", "rocm7.2", {"HIP_VISIBLE_DEVICES": "0"}, None),
    "amd-smi__list_and_version": ("full", "rocm", "rocm6.4", {}, None),  # host ROCm 6.4.0
    "nvidia-smi__q_linux__a100": ("full", "cuda", "cu126", {}, "CUDA 12.4"),
    "nvidia-smi__r610_kmd_header__rtx5090": ("full", "cuda", "cu130", {}, None),
    "nvidia-smi__windows_driver_model__rtx4070": ("full", "cuda", "cu126", {}, None),  # a 12.8 driver: cu126 carries the newer torch
    "nvidia-smi__truncated_name": ("limited", "cpu", "cpu", {}, "470.182.03 is too old"),
    "lspci__nnk_nvidia_audio_amd_igpu": ("full", "cuda", "cu130", {}, "No NVIDIA driver"),
    "lspci__intel_arc_and_uhd": ("limited", "xpu", "xpu", {}, None),  # the A770 (8086:56a0), not the UHD 770
    "macos__apple_m2": ("limited", "mps", None, {}, None),
    "rocminfo__rock_not_loaded": ("limited", "cpu", "cpu", {}, None),
}


def plan_of(name: str, matrix) -> dict:
    platform, _ = detect_from_dump(DUMPS / name)
    return resolve(platform, matrix).to_json()


def test_there_are_dumps_with_plans():
    assert len(WITH_PLAN) >= 5


@pytest.mark.parametrize("name", WITH_PLAN)
def test_expect_json_plan(name, matrix):
    expected = json.loads((DUMPS / name / "expect.json").read_text())["plan"]
    assert expect_compare.compare_plan(expected, plan_of(name, matrix)) == []


@pytest.mark.parametrize("name", sorted(OURS))
def test_our_plan_expectations(name, matrix):
    support, backend, variant, env, warning = OURS[name]
    plan = plan_of(name, matrix)
    assert (plan["support"], plan["torch"]["backend"], plan["torch"]["variant"]) == (support, backend, variant)
    assert plan["env"] == env
    if warning:
        assert any(warning in advice["message"] for advice in plan["warnings"]), plan["warnings"]
