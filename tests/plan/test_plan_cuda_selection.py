"""NVIDIA: driver version and compute capability -> PyTorch CUDA index."""

from __future__ import annotations

import pytest
from plan_helpers import machine, nvidia

from unsloth.plan import resolve


def plan_for(matrix, arch="sm_89", os_name="linux", driver=None, cuda=None, **gpu):
    platform = machine(os_name, nvidia(arch, **gpu))
    platform.nvidia_driver, platform.cuda_driver = driver, cuda
    return resolve(platform, matrix)


@pytest.mark.parametrize(
    ("driver", "cuda", "variant"),
    [
        ("580.65.06", "13.0", "cu130"),
        ("610.12", "13.2", "cu130"),  # R610+ drivers: any newer driver keeps the newest build
        ("580.65.06", None, "cu130"),  # CUDA version unreadable: the driver decides
        # 12.8-12.9 drivers run cu128 (torch < 2.12) and cu126 (torch < 2.14): the newer torch wins
        ("575.51.03", "12.9", "cu126"),
        ("570.86.15", "12.8", "cu126"),
        ("560.35.03", "12.6", "cu126"),
    ],
)
def test_driver_picks_the_index_with_the_newest_torch_it_runs(matrix, driver, cuda, variant):
    plan = plan_for(matrix, driver=driver, cuda=cuda)
    assert plan.torch.variant == variant
    assert plan.torch.index_url == f"https://download.pytorch.org/whl/{variant}"
    assert plan.torch.backend == "cuda" and plan.support == "full"
    assert plan.warnings == []


def test_older_12x_driver_runs_cu126_through_minor_version_compatibility(matrix):
    plan = plan_for(matrix, driver="550.54.14", cuda="12.4")
    assert plan.torch.variant == "cu126"
    [advice] = plan.warnings
    assert "CUDA 12.4" in advice.message and "minor-version" in advice.message
    assert "12.6" in advice.fix


@pytest.mark.parametrize(
    ("os_name", "too_old", "just_enough", "minimum"),
    [
        ("linux", "525.60.12", "525.60.13", "525.60.13"),
        ("windows", "528.24", "528.33", "528.33"),
        ("wsl", "527.41", "528.33", "528.33"),  # WSL sees the Windows host driver: Windows minimums
    ],
)
def test_driver_too_old_for_every_build(matrix, os_name, too_old, just_enough, minimum):
    plan = plan_for(matrix, os_name=os_name, driver=too_old, cuda="12.0")
    assert plan.torch.backend == "cpu" and plan.device is None
    assert plan.support == "limited"  # what runs is the CPU build
    [advice] = plan.warnings
    assert f"(the minimum is {minimum} on" in advice.message
    assert f"Update the NVIDIA driver to {minimum} or newer" in advice.fix

    ok = plan_for(matrix, os_name=os_name, driver=just_enough, cuda="12.0")
    assert ok.torch.variant == "cu126" and ok.support == "full"


def test_linux_minimum_is_not_applied_to_wsl(matrix):
    assert plan_for(matrix, os_name="linux", driver="526.0", cuda="12.0").torch.backend == "cuda"
    assert plan_for(matrix, os_name="wsl", driver="526.0", cuda="12.0").torch.backend == "cpu"


@pytest.mark.parametrize("arch", ["sm_50", "sm_61", "sm_70"])
def test_pre_turing_is_capped_to_cu126_whatever_the_driver(matrix, arch):
    plan = plan_for(matrix, arch=arch, driver="590.10", cuda="13.1")
    assert plan.torch.variant == "cu126"
    assert plan.support == "limited"
    assert "CUDA 13 wheels dropped" in plan.reason


def test_blackwell_needs_cu128_or_newer(matrix):
    # cu126 has no sm_120 kernels: even a CUDA 12.6 driver gets cu128 (with a note to update).
    plan = plan_for(matrix, arch="sm_120", driver="560.35.03", cuda="12.6")
    assert plan.torch.variant == "cu128"
    assert any("CUDA 12.8" in advice.fix for advice in plan.warnings)


def test_blackwell_on_a_12_8_driver_keeps_cu128_the_newest_torch_that_has_its_kernels(matrix):
    plan = plan_for(matrix, arch="sm_120", driver="570.86.15", cuda="12.8")
    assert plan.torch.variant == "cu128" and plan.warnings == []


def test_equal_torch_ceilings_take_the_newer_cuda(matrix):
    """cu130 and cu126 both carry torch < 2.14: a 580 driver that reports CUDA 13 gets cu130."""
    assert {index.variant: index.torch for index in matrix.cuda_indexes}["cu126"] == \
        {index.variant: index.torch for index in matrix.cuda_indexes}["cu130"]
    assert plan_for(matrix, arch="sm_90", driver="580.65.06", cuda="13.0").torch.variant == "cu130"


def test_compute_capability_field_is_enough(matrix):
    platform = machine("linux", nvidia("sm_61"))
    platform.gpus[0].arch, platform.gpus[0].compute_capability = None, "6.1"
    assert resolve(platform, matrix).torch.variant == "cu126"


def test_no_driver_still_plans_cuda_and_says_which_driver(matrix):
    plan = plan_for(matrix, driver=None, cuda=None)
    assert plan.torch.variant == "cu130"
    [advice] = plan.warnings
    assert "No NVIDIA driver" in advice.message
    assert "580" in advice.fix


def test_kepler_gets_cpu_and_the_reason(matrix):
    plan = plan_for(matrix, arch="sm_35", driver="470.256.02", cuda="11.4")
    assert plan.support == "unsupported" and plan.torch.backend == "cpu"
    assert "Kepler" in plan.reason


def test_unidentified_nvidia_model_plans_by_driver(matrix):
    # nvidia-smi truncates long names ("NVIDIA GeForce ..."): no generation, but a working driver.
    platform = machine("linux", nvidia("sm_89", name="NVIDIA GeForce ..."))
    platform.gpus[0].arch = None
    plan = resolve(platform, matrix)
    assert (plan.support, plan.torch.variant) == ("limited", "cu130")
    assert plan.device is platform.gpus[0] and plan.family is None
    [advice] = plan.warnings
    assert "compute_cap" in advice.fix and "whl/cu126" in advice.fix


def test_unidentified_nvidia_without_driver_gets_cpu(matrix):
    platform = machine("linux", nvidia("sm_89"))
    platform.gpus[0].arch, platform.nvidia_driver = None, None
    plan = resolve(platform, matrix)
    assert plan.torch.backend == "cpu"
    assert "no GPU the hardware matrix knows" in plan.device_reason


def test_a_torch_range_reaches_its_tightest_upper_bound_and_a_pin_is_its_own():
    from packaging.version import Version

    from unsloth.plan.versions import NO_CEILING, torch_ceiling

    assert torch_ceiling(">=2.9,<2.14") == Version("2.14")
    assert torch_ceiling("<=2.12.1,<2.14") == Version("2.12.1")
    assert torch_ceiling("==2.11.0") == Version("2.11.0")  # a pinned index does not outrank a newer range
    assert torch_ceiling("==2.11.*") == Version("2.11")
    assert torch_ceiling(">=2.9") == NO_CEILING
