"""AMD: ROCm version and gfx target -> index, HSA overrides, runtime warnings."""

from __future__ import annotations

import pytest
from plan_helpers import amd, machine

from unsloth.plan import resolve


def plan_for(matrix, arch="gfx1100", os_name="linux", rocm="7.2.1", **facts):
    platform = machine(os_name, amd(arch))
    platform.rocm_version = rocm
    for key, value in facts.items():
        setattr(platform, key, value)
    return resolve(platform, matrix)


@pytest.mark.parametrize(
    ("rocm", "variant"),
    [
        ("7.2.1", "rocm7.2"),
        ("7.2", "rocm7.2"),
        ("7.1.0", "rocm7.1"),
        ("6.4.1", "rocm6.4"),
        ("10.0.0", "rocm7.2"),
        ("7.14.0", "rocm7.2"),
    ],
)
def test_host_rocm_picks_the_newest_index_not_newer_than_it(matrix, rocm, variant):
    plan = plan_for(matrix, rocm=rocm)
    assert plan.torch.variant == variant
    assert plan.torch.index_url == f"https://download.pytorch.org/whl/{variant}"
    assert plan.warnings == []


def test_host_rocm_older_than_every_index_asks_for_an_upgrade(matrix):
    plan = plan_for(matrix, rocm="6.3.3")
    assert plan.torch.variant == "rocm6.4"  # the closest build above the host
    [advice] = plan.warnings
    assert "ROCm 6.3.3 is older" in advice.message
    assert advice.fix.startswith("Upgrade ROCm to 6.4") and "rocm.docs.amd.com" in advice.fix


@pytest.mark.parametrize(
    ("arch", "rocm", "variant", "needs"),
    [
        ("gfx1151", "7.1.0", "rocm7.2", "7.2"),
        ("gfx1151", "6.4.0", "rocm7.2", "7.2"),
        ("gfx950", "6.4.1", "rocm7.1", "7.1"),
    ],
)
def test_arch_only_in_newer_index_takes_that_index(matrix, arch, rocm, variant, needs):
    plan = plan_for(matrix, arch=arch, rocm=rocm)
    assert plan.torch.variant == variant
    assert plan.env == {}  # a newer index, never an override that spoofs another arch
    assert any(advice.fix.startswith(f"Upgrade ROCm to {needs}") for advice in plan.warnings)


def test_rocm_missing_on_linux_still_plans_rocm_and_says_how_to_install(matrix):
    plan = plan_for(matrix, rocm=None)
    assert (plan.support, plan.torch.backend, plan.torch.variant) == ("full", "rocm", "rocm7.2")
    [advice] = plan.warnings
    assert "ROCm was not found" in advice.message
    assert advice.fix == "Install ROCm 7.2: https://rocm.docs.amd.com/projects/install-on-linux/en/latest/"


def test_a_rocm_tool_that_answered_is_rocm_installed_without_a_version(matrix):
    """The planner reads detection's rocm_installed fact, not which probe files a dump holds."""
    plan = plan_for(matrix, rocm=None, rocm_installed=True)
    assert not any("ROCm was not found" in advice.message for advice in plan.warnings)
    assert any("ROCm was not found" in advice.message for advice in plan_for(matrix, rocm=None, rocm_installed=False).warnings)


def test_missing_dev_kfd_is_reported(matrix):
    plan = plan_for(matrix, dev_kfd=False)
    assert any("/dev/kfd" in advice.message and "render,video" in advice.fix for advice in plan.warnings)


def test_wsl_without_dxg_or_rocm(matrix):
    plan = plan_for(matrix, os_name="wsl", rocm=None, dev_dxg=False)
    assert plan.env == {"HSA_ENABLE_DXG_DETECTION": "1"}
    messages = " ".join(advice.message for advice in plan.warnings)
    assert "/dev/dxg is missing" in messages and "ROCm was not found inside WSL" in messages


@pytest.mark.parametrize(
    ("arch", "override", "effective"),
    [
        ("gfx1031", "10.3.0", "gfx1030"),
        ("gfx1032", "10.3.0", "gfx1030"),
        ("gfx1035", "10.3.0", "gfx1030"),
        ("gfx1036", "10.3.0", "gfx1030"),
        ("gfx1103", "11.0.0", "gfx1100"),
    ],
)
def test_arch_no_index_ships_gets_the_override_on_linux_only(matrix, arch, override, effective):
    linux = plan_for(matrix, arch=arch)
    assert linux.env == {"HSA_OVERRIDE_GFX_VERSION": override}
    assert linux.torch.variant == "rocm7.2"
    assert linux.llama_cpp.cmake_args == f"-DGGML_HIP=on -DAMDGPU_TARGETS={effective}"
    assert linux.device.arch == arch  # the plan never rewrites the real silicon

    windows = plan_for(matrix, arch=arch, os_name="windows", rocm=None)
    assert "HSA_OVERRIDE_GFX_VERSION" not in windows.env


def test_gfx1103_on_windows_uses_amds_rdna3_wheels(matrix):
    plan = plan_for(matrix, arch="gfx1103", os_name="windows", rocm=None)
    assert plan.torch.index_url == "https://repo.amd.com/rocm/whl/gfx110X-all/"
    assert plan.env == {}
    assert plan.bitsandbytes.source == "none"  # bitsandbytes' Windows build lacks gfx1103
    assert (plan.llama_cpp.backend, plan.llama_cpp.how) == ("hip", "source")  # hip-radeon lacks it too
    assert plan.llama_cpp.cmake_args == "-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1103"


def test_arch_without_pytorch_index_or_override_uses_amds_index_on_linux(matrix):
    plan = plan_for(matrix, arch="gfx1152")
    assert (plan.torch.backend, plan.torch.variant) == ("rocm", "gfx1152")
    assert plan.torch.index_url == "https://repo.amd.com/rocm/whl/gfx1152/"
    assert plan.env == {}
    assert plan.bitsandbytes.source == "pypi"
    assert plan.llama_cpp.how == "source"  # the rocm72 wheel has no gfx1152


def test_amd_gpu_without_gfx_target_gets_cpu_and_a_fix(matrix):
    plan = plan_for(matrix, arch=None, rocm=None)
    assert plan.torch.backend == "cpu" and plan.device is None
    advice = next(a for a in plan.warnings if "gfx target could not be read" in a.message)
    assert "rocminfo" in advice.fix and "unsloth install" in advice.fix
    assert plan.llama_cpp.backend == "vulkan"


def test_user_override_that_spoofs_is_flagged_and_ignored(matrix):
    # Strix Halo with the common 11.0.0 "fix": ROCm would load gfx1100 kernels on gfx1151.
    plan = plan_for(
        matrix,
        arch="gfx1151",
        hsa_override="11.0.0",
        hsa_override_spoofs=True,
        env={"HSA_OVERRIDE_GFX_VERSION": "11.0.0"},
    )
    assert plan.torch.variant == "rocm7.2" and plan.device.arch == "gfx1151"
    assert "HSA_OVERRIDE_GFX_VERSION" not in plan.env
    [advice] = plan.warnings
    assert "report gfx1100 instead of the real gfx1151" in advice.message
    assert advice.fix.startswith("unset HSA_OVERRIDE_GFX_VERSION")


def test_user_override_matching_the_plan_is_fine(matrix):
    plan = plan_for(matrix, arch="gfx1031", hsa_override="10.3.0", hsa_override_spoofs=True)
    assert plan.env == {"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}
    assert plan.warnings == []


def test_user_override_on_windows_is_pointless(matrix):
    plan = plan_for(matrix, os_name="windows", rocm=None, env={"HSA_OVERRIDE_GFX_VERSION": "11.0.0"})
    assert "HSA_OVERRIDE_GFX_VERSION" not in plan.env
    [advice] = plan.warnings
    assert "no effect on Windows" in advice.message


def test_rocm_on_arm_has_no_bitsandbytes(matrix):
    plan = plan_for(matrix, arch="gfx942", machine="aarch64")
    assert plan.torch.backend == "rocm"
    assert plan.bitsandbytes.source == "none"


def test_llama_cpp_wheels_follow_the_gfx_target(matrix):
    assert plan_for(matrix, arch="gfx1201").llama_cpp.to_json() == {
        "backend": "hip",
        "how": "wheel",
        "package": "llama-cpp-python",
        "index_url": "https://abetlen.github.io/llama-cpp-python/whl/rocm72",
        "cmake_args": "-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1201",
    }
    windows = plan_for(matrix, arch="gfx1201", os_name="windows", rocm=None)
    assert windows.llama_cpp.index_url.endswith("/whl/hip-radeon")


def _apu_with_dgpu(igpu_arch: str, dgpu_arch: str, **facts):
    igpu = amd(igpu_arch, name="Radeon 780M", integrated=True, index=0)
    dgpu = amd(dgpu_arch, name="Radeon RX dGPU", index=1)
    igpu.kfd_node, dgpu.kfd_node = 1, 2  # KFD node 0 is the CPU
    return machine("linux", igpu, dgpu, **facts)


def test_an_override_beside_an_amd_gpu_of_another_target_is_per_node(matrix):
    # The 780M (gfx1103, runs as gfx1100 with 11.0.0) is full, the RX 6700 XT (gfx1031) limited:
    # the global variable would also make the 6700 XT load gfx1100 kernels.
    plan = resolve(_apu_with_dgpu("gfx1103", "gfx1031"), matrix)
    assert plan.device.arch == "gfx1103"
    assert plan.env["HSA_OVERRIDE_GFX_VERSION_1"] == "11.0.0"
    assert "HSA_OVERRIDE_GFX_VERSION" not in plan.env


def test_the_dgpus_override_names_its_own_node(matrix):
    # gfx1031 dGPU beside a gfx1036 iGPU: both RDNA2 and both need 10.3.0, but they are different
    # targets, so only the training GPU (node 2) gets it.
    plan = resolve(_apu_with_dgpu("gfx1036", "gfx1031"), matrix)
    assert plan.device.arch == "gfx1031"
    assert {k: v for k, v in plan.env.items() if k.startswith("HSA")} == {"HSA_OVERRIDE_GFX_VERSION_2": "10.3.0"}


def test_peers_of_one_target_keep_the_global_override(matrix):
    cards = [amd("gfx1031", index=n) for n in range(2)]
    for node, card in enumerate(cards, start=1):
        card.kfd_node = node
    plan = resolve(machine("linux", *cards), matrix)
    assert plan.env == {"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}


def test_without_a_node_id_the_override_stays_global(matrix):
    platform = _apu_with_dgpu("gfx1103", "gfx1031")
    platform.gpus[0].kfd_node = None
    assert resolve(platform, matrix).env["HSA_OVERRIDE_GFX_VERSION"] == "11.0.0"


def test_a_global_override_set_by_hand_is_flagged_when_the_plan_is_per_node(matrix):
    plan = resolve(_apu_with_dgpu("gfx1103", "gfx1031", hsa_override="11.0.0"), matrix)
    [advice] = [w for w in plan.warnings if w.check == "hsa-override"]
    assert "HSA_OVERRIDE_GFX_VERSION_1=11.0.0" in advice.message and advice.fix.startswith("unset")


@pytest.mark.parametrize(("arch", "leaf"), [("gfx1103", "gfx110X-all"), ("gfx1150", "gfx1150"),
                                            ("gfx1151", "gfx1151"), ("gfx1152", "gfx1152")])
def test_phoenix_and_strix_apus_on_windows_use_amds_windows_wheels(matrix, arch, leaf):
    plan = resolve(machine("windows", amd(arch, integrated=True)), matrix)
    assert (plan.support, plan.torch.backend, plan.torch.variant) == ("full", "rocm", leaf)
    assert plan.torch.index_url == f"https://repo.amd.com/rocm/whl/{leaf}/"
    assert not any(k.startswith("HSA_OVERRIDE") for k in plan.env)  # no HSA override on Windows
