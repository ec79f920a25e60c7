"""flash-linear-attention in the plan: installed where its Triton kernels run and are right (CUDA on Linux
and WSL, ROCm, Intel XPU), left out with the reason elsewhere, and on Hopper when the Triton the plan's
torch pins breaks its gated backward (fla refuses it: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs
produces incorrect results"). Real captured tool outputs through detection and the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from unsloth.matrix import default_path, load_matrix
from unsloth.plan import FlashLinearAttention, Plan, resolve
from unsloth.plan.extras import NO_CAUSAL_CONV1D, TORCH_PATH, pinned_triton
from unsloth.platform.detect import detect_from_dump

from plan_helpers import machine, nvidia

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "dumps"
HOPPER_BROKEN = ">=3.4.0,<3.7.1"

# dump -> (installed?, the Triton the plan's torch pins, the broken range carried for doctor, a phrase of the note)
CASES = {
    # Hopper, current driver: cu130's newest torch (2.13) pins Triton 3.7.1, which fla is right with.
    "nvidia-smi__q_i0_of_four__h100": (True, "3.7.1", HOPPER_BROKEN, NO_CAUSAL_CONV1D),
    # Hopper whose driver reports no CUDA 13: cu126's torch 2.13 (not cu128's 2.11, Triton 3.6.0) keeps fla in.
    "nvidia-smi__cuda_err__h100": (True, "3.7.1", HOPPER_BROKEN, NO_CAUSAL_CONV1D),
    "nvidia-smi__q_linux__a100": (True, "3.7.1", None, NO_CAUSAL_CONV1D),  # Ampere
    "nvidia-smi__csv_name_compute_cap__l40s": (True, "3.7.1", None, NO_CAUSAL_CONV1D),  # Ada
    "nvidia-smi__r610_kmd_header__rtx5090": (True, "3.7.1", None, NO_CAUSAL_CONV1D),  # Blackwell
    "nvidia-smi__csv_header__t4": (True, "3.7.1", None, NO_CAUSAL_CONV1D),  # Turing
    "nvidia-smi__q_wsl__rtx4080": (True, "3.7.1", None, NO_CAUSAL_CONV1D),  # WSL
    "rocminfo__gfx942-mi300x__1": (True, None, None, NO_CAUSAL_CONV1D),  # AMD Instinct (ROCm pins its own Triton)
    "linux-full__7900xtx_all_probes": (True, None, None, NO_CAUSAL_CONV1D),  # AMD Radeon
    "lspci__intel_arc_and_uhd": (True, None, None, NO_CAUSAL_CONV1D),  # Intel Arc (XPU)
    "nvidia-smi__windows_wddm__rtx3090": (False, None, None, "CUDA PyTorch on native Windows brings no Triton"),
    "Get-WmiObject__gfx1036+gfx1100_windows__1": (False, None, None, "ROCm PyTorch on native Windows brings no Triton"),
    "macos__apple_m2": (False, None, None, "this plan's PyTorch is MPS"),
    "rocminfo__rock_not_loaded": (False, None, None, "this plan's PyTorch is CPU"),  # no usable GPU
}


def plan_of(name: str, matrix) -> Plan:
    platform, _ = detect_from_dump(DUMPS / name)
    return resolve(platform, matrix)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fla_is_in_or_out_of_the_plan_with_the_reason(name, matrix):
    installed, triton, broken, phrase = CASES[name]
    plan = plan_of(name, matrix)
    fla = plan.flash_linear_attention
    assert fla.available is installed, fla.note
    assert (fla.triton, fla.broken_triton) == (triton, broken)
    assert phrase in fla.note and "\n" not in fla.note
    if installed:
        (row,) = [r for r in matrix.flash_linear_attention if r.backend == plan.torch.backend]
        assert fla.spec == row.spec and row.source in plan.sources
    else:
        assert fla.spec is None and TORCH_PATH in fla.note


def _matrix_with(tmp_path, old: str, new: str, count: int = 1):
    text = default_path().read_text(encoding="utf-8")
    assert text.count(old) >= count, old
    path = tmp_path / "matrix.toml"
    path.write_text(text.replace(old, new, count), encoding="utf-8")
    return load_matrix(path)


def test_hopper_left_out_names_the_gpu_the_tritons_and_a_driver_that_fixes_it(tmp_path):
    """A matrix whose 12.x builds all stop before torch 2.12 (cu126 held to cu128's torch): the 12.8
    driver's H100 gets torch 2.11, Triton 3.6.0, and fla is left out with the fix."""
    cu126 = 'sm = ["5.0", "9.0"]\ntorch = ">=2.9,<2.14"'
    matrix = _matrix_with(tmp_path, cu126, 'sm = ["5.0", "9.0"]\ntorch = ">=2.9,<2.12"')
    platform, _ = detect_from_dump(DUMPS / "nvidia-smi__cuda_err__h100")
    plan = resolve(platform, matrix)
    note = plan.flash_linear_attention.note
    assert plan.flash_linear_attention.available is False and "torch 2.12.1 or newer (Triton 3.7.1)" in note
    assert plan.torch.variant == "cu128" and plan.torch.version_spec in note
    assert "H100" in note and "compute capability 9.0" in note and HOPPER_BROKEN in note
    assert "cu130 build has (NVIDIA driver 580 or newer)" in note
    assert matrix.sources["torch_triton"] in plan.sources  # the Triton it read is cited


def test_a_vllm_torch_pin_decides_the_triton_too(matrix):
    """The Triton is that of the torch the plan finally installs: vLLM's exact pin, not the index's newest."""
    platform = machine("linux", nvidia("sm_90", name="NVIDIA H200"))
    plan = resolve(platform, matrix, with_parts=("vllm",))
    (row,) = matrix.vllm
    assert plan.torch.version_spec == f"torch{row.torch}"
    assert plan.flash_linear_attention.triton == str(matrix.torch_triton[Version(row.torch.lstrip("="))])


def test_a_hopper_plan_on_a_torch_with_broken_triton_leaves_it_out_and_others_keep_it(tmp_path):
    """cu130 and cu126 held to torch 2.12.0 (Triton 3.7.0): out on Hopper, in on Ada and Blackwell."""
    matrix = _matrix_with(tmp_path, 'torch = ">=2.9,<2.14"', 'torch = ">=2.9,<2.12.1"', count=2)
    for arch, installed in (("sm_90", False), ("sm_89", True), ("sm_120", True)):
        fla = resolve(machine("linux", nvidia(arch)), matrix).flash_linear_attention
        assert (fla.available, fla.triton) == (installed, "3.7.0"), (arch, fla.note)


def test_the_triton_is_the_newest_admitted_releases_or_unknown():
    table = {Version(t): Version(tr) for t, tr in
             {"2.11.0": "3.6.0", "2.12.0": "3.7.0", "2.12.1": "3.7.1", "2.13.0": "3.7.1", "2.14.0": "3.8.0"}.items()}
    assert pinned_triton(table, "torch>=2.9,<2.12.1") == Version("3.7.0")
    assert pinned_triton(table, "torch>=2.9,<2.14") == Version("3.7.1")
    assert pinned_triton(table, "torch==2.11.0") == Version("3.6.0")
    assert pinned_triton(table, "torch<2.3") is None  # older than the table knows
    assert pinned_triton(table, "torch>=2.9,<2.15") is None  # may install a torch newer than the table knows
    assert pinned_triton(table, "torch>=2.9,<2.14.1") == Version("3.8.0")
    assert pinned_triton(table, None) is None
    assert pinned_triton({}, "torch==2.13.0") is None


def test_unknown_triton_on_hopper_installs_it_and_carries_the_range_for_doctor(tmp_path):
    text = default_path().read_text(encoding="utf-8")
    path = tmp_path / "matrix.toml"
    path.write_text(text.replace('torch = ">=2.9,<2.14"', 'torch = ">=2.9,<2.20"', 1), encoding="utf-8")
    fla = resolve(machine("linux", nvidia("sm_90")), load_matrix(path)).flash_linear_attention
    assert (fla.available, fla.triton, fla.broken_triton) == (True, None, HOPPER_BROKEN)


def test_a_matrix_without_rows_plans_none_and_its_json_reads_as_before(tmp_path):
    text = default_path().read_text(encoding="utf-8")
    start = text.index("\n[[flash_linear_attention]]")
    end = text.index("\n# ---", start)  # its rows and the [torch_triton] table after them
    path = tmp_path / "matrix.toml"
    path.write_text(text[:start] + text[end:], encoding="utf-8")
    plan = resolve(machine("linux", nvidia("sm_89")), load_matrix(path))
    assert plan.flash_linear_attention is None and "flash_linear_attention" not in plan.to_json()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_json_round_trips_with_fla(name, matrix):
    data = json.loads(json.dumps(plan_of(name, matrix).to_json()))
    assert set(data["flash_linear_attention"]) == {"source", "spec", "note", "triton", "broken_triton"}
    plan = Plan.from_json(data)
    assert isinstance(plan.flash_linear_attention, FlashLinearAttention)
    assert plan.to_json() == data


def test_a_receipt_plan_from_before_fla_reads_back_without_it(matrix):
    data = json.loads(json.dumps(plan_of("nvidia-smi__q_linux__a100", matrix).to_json()))
    del data["flash_linear_attention"]
    assert Plan.from_json(data).flash_linear_attention is None
