"""Several GPUs: which one becomes the compute device, and why."""

from __future__ import annotations

from plan_helpers import amd, machine, nvidia

from unsloth.plan import resolve
from unsloth.platform.facts import Gpu


def test_laptop_discrete_nvidia_beats_intel_igpu(matrix):
    igpu = Gpu("intel", name="Intel(R) UHD Graphics 770", integrated=True, index=0)
    dgpu = nvidia("sm_89", name="NVIDIA GeForce RTX 4060 Laptop GPU", vram_gib=8, index=0)
    plan = resolve(machine("windows", igpu, dgpu), matrix)
    assert plan.device is dgpu and plan.torch.backend == "cuda"
    assert "Intel(R) UHD Graphics 770" in plan.device_reason


def test_discrete_beats_integrated_even_when_both_are_full(matrix):
    igpu = amd("gfx1103", name="AMD Radeon 780M", integrated=True, vram_gib=2, index=0)
    dgpu = nvidia("sm_89", name="NVIDIA GeForce RTX 4070 Laptop GPU", vram_gib=8, index=0)
    plan = resolve(machine("linux", igpu, dgpu), matrix)
    assert plan.device is dgpu
    assert "integrated" in plan.device_reason
    assert "HSA_OVERRIDE_GFX_VERSION" not in plan.env  # the iGPU is not planned for


def test_windows_raphael_igpu_and_7900xtx(matrix):
    igpu = amd("gfx1036", name="AMD Radeon(TM) Graphics", integrated=True, vram_gib=0.5)
    dgpu = amd("gfx1100", name="AMD Radeon RX 7900 XTX", vram_gib=24)
    plan = resolve(machine("windows", igpu, dgpu), matrix)
    assert plan.device is dgpu and plan.support == "full"
    assert "unsupported on windows" in plan.device_reason
    assert plan.env == {}


def test_windows_plan_says_several_gpus_do_not_train_together(matrix):
    first, second = (nvidia("sm_89", name="NVIDIA GeForce RTX 4090", vram_gib=24, index=i) for i in (0, 1))
    [advice] = resolve(machine("windows", first, second), matrix).warnings
    assert "2 NVIDIA GPUs" in advice.message and "not supported on Windows" in advice.message
    assert "WSL or Linux" in advice.fix
    assert resolve(machine("linux", first, second), matrix).warnings == []


def test_linux_amd_igpu_is_hidden_from_hip(matrix):
    igpu = amd("gfx1036", name="AMD Radeon(TM) Graphics", integrated=True, vram_gib=0.5, index=0)
    dgpu = amd("gfx1100", name="AMD Radeon RX 7900 XTX", vram_gib=24, index=1)
    plan = resolve(machine("linux", igpu, dgpu), matrix)
    assert plan.device is dgpu
    assert plan.env == {"HIP_VISIBLE_DEVICES": "1"}


def test_full_support_beats_limited_across_vendors(matrix):
    old = nvidia("sm_61", name="NVIDIA GeForce GTX 1080", vram_gib=8)
    new = amd("gfx1100", name="AMD Radeon RX 7900 XTX", vram_gib=24)
    plan = resolve(machine("linux", old, new), matrix)
    assert plan.device is new and plan.torch.variant == "rocm7.2"
    assert "limited on linux" in plan.device_reason


def test_nvidia_preferred_when_both_vendors_are_full(matrix):
    radeon = amd("gfx1100", name="AMD Radeon RX 7900 XTX", vram_gib=24)
    geforce = nvidia("sm_86", name="NVIDIA GeForce RTX 3090", vram_gib=24)
    plan = resolve(machine("linux", radeon, geforce), matrix)
    assert plan.device is geforce and plan.torch.backend == "cuda"
    assert "NVIDIA CUDA preferred over amd" in plan.device_reason


def test_unsupported_nvidia_is_hidden_from_cuda(matrix):
    kepler = nvidia("sm_37", name="Tesla K80", vram_gib=12, index=0)
    ampere = nvidia("sm_80", name="NVIDIA A100-SXM4-40GB", vram_gib=40, index=1)
    plan = resolve(machine("linux", kepler, ampere), matrix)
    assert plan.device is ampere
    assert plan.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}


def test_identical_gpus_stay_visible_and_the_first_is_named(matrix):
    first, second = nvidia("sm_89", index=0), nvidia("sm_89", index=1)
    plan = resolve(machine("linux", first, second), matrix)
    assert plan.device is first
    assert plan.env == {}


def test_more_vram_wins_among_equals(matrix):
    small = nvidia("sm_86", name="NVIDIA RTX A4000", vram_gib=16, index=0)
    big = nvidia("sm_86", name="NVIDIA RTX A6000", vram_gib=48, index=1)
    plan = resolve(machine("linux", small, big), matrix)
    assert plan.device is big
    assert plan.fits.memory_gib == 48.0


def test_strix_halo_igpu_alone_is_the_device(matrix):
    apu = amd("gfx1151", name="AMD Radeon 8060S", integrated=True, vram_gib=96)
    plan = resolve(machine("linux", apu), matrix)
    assert plan.device is apu and plan.support == "full"
    assert plan.device_reason.endswith("the only GPU")
