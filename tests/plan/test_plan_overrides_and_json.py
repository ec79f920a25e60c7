"""User pins and mirrors, the macOS paths, the fits table, and the JSON shape of a Plan."""

from __future__ import annotations

import json

import pytest
from plan_helpers import GIB, amd, machine, nvidia

from unsloth.plan import Overrides, resolve
from unsloth.platform.facts import Gpu


def test_torch_index_pin_is_used_verbatim(matrix):
    url = "https://mirror.example.org/pytorch/whl/cu126"
    plan = resolve(machine("linux", nvidia("sm_89")), matrix, overrides={"torch_index_url": url})
    assert (plan.torch.backend, plan.torch.variant, plan.torch.index_url) == ("cuda", "cu126", url)
    assert plan.warnings == []


def test_pin_for_another_backend_warns(matrix):
    plan = resolve(
        machine("linux", nvidia("sm_89")),
        matrix,
        overrides=Overrides(torch_index_url="https://download.pytorch.org/whl/cpu"),
    )
    assert plan.torch.backend == "cpu"
    [advice] = plan.warnings
    assert "pins a cpu build" in advice.message and "Unset UNSLOTH_TORCH_INDEX_URL" in advice.fix


def test_pytorch_mirror_replaces_the_base(matrix):
    pins = Overrides(pytorch_mirror="https://mirror.example.org/pytorch/whl/")
    assert (
        resolve(machine("linux", nvidia("sm_89")), matrix, overrides=pins).torch.index_url
        == "https://mirror.example.org/pytorch/whl/cu130"
    )
    assert (
        resolve(machine("linux"), matrix, overrides=pins).torch.index_url
        == "https://mirror.example.org/pytorch/whl/cpu"
    )


def test_amd_mirror_replaces_repo_amd_com(matrix):
    pins = Overrides(amd_mirror="https://amd.mirror.example.org/whl")
    plan = resolve(machine("windows", amd("gfx1201")), matrix, overrides=pins)
    assert plan.torch.index_url == "https://amd.mirror.example.org/whl/gfx120X-all/"


def test_overrides_from_env():
    pins = Overrides.from_env(
        {"UNSLOTH_TORCH_INDEX_URL": " https://x.example/whl/cu130 ", "UNSLOTH_PYTORCH_MIRROR": "", "HOME": "/root"}
    )
    assert pins == Overrides(torch_index_url="https://x.example/whl/cu130")


def test_apple_silicon_gets_mps_from_pypi(matrix):
    plan = resolve(machine("macos", machine="arm64"), matrix)
    assert (plan.support, plan.torch.backend, plan.torch.index_url) == ("limited", "mps", "https://pypi.org/simple")
    assert plan.llama_cpp.index_url == "https://abetlen.github.io/llama-cpp-python/whl/metal"


def test_apple_gpu_means_apple_silicon_even_without_machine(matrix):
    apple = Gpu("apple", name="Apple M2", integrated=True)
    plan = resolve(machine("macos", apple, machine=None), matrix)
    assert (plan.torch.backend, plan.device, plan.family) == ("mps", apple, "Apple")
    assert plan.warnings == []


def test_intel_mac_gets_the_last_cpu_wheels(matrix):
    plan = resolve(machine("macos"), matrix)
    assert (plan.torch.backend, plan.torch.version_spec) == ("cpu", "torch<2.3")
    assert any("Intel-Mac" in advice.message for advice in plan.warnings)


def test_fits_follows_the_documented_formula(matrix):
    plan = resolve(machine("linux", nvidia("sm_89", vram_gib=24)), matrix)
    row = next(r for r in plan.fits.table if r.params_b == 7)
    # 7e9 params x 0.5625 B x 1.2 / 2^30 + 1.5 GiB; 7e9 x 2 B x 1.2 / 2^30 + 1.5 GiB
    assert (row.qlora_gib, row.lora16_gib) == (5.9, 17.1)
    assert (plan.fits.qlora_max_b, plan.fits.lora16_max_b) == (32, 8)


def test_no_qlora_without_bitsandbytes(matrix):
    plan = resolve(machine("linux", nvidia("sm_52", vram_gib=12)), matrix)  # Maxwell: no bnb kernels
    assert plan.bitsandbytes.to_json() == {"source": "none", "spec": None, "note": plan.bitsandbytes.note}
    assert plan.fits.qlora_max_b is None and plan.fits.lora16_max_b == 4


def test_cpu_plan_fits_in_ram(matrix):
    plan = resolve(machine("linux", ram_bytes=64 * GIB), matrix)
    assert (plan.fits.memory, plan.fits.memory_gib) == ("ram", 64.0)


@pytest.mark.parametrize("os_name", ["linux", "windows"])
def test_plan_json_shape(matrix, os_name):
    plan = resolve(machine(os_name, nvidia("sm_89"), amd("gfx1036", integrated=True)), matrix)
    data = json.loads(json.dumps(plan.to_json()))
    assert data["support"] in ("full", "limited", "unsupported")
    assert set(data["torch"]) == {"backend", "variant", "index_url", "version_spec", "packages"}
    assert set(data["bitsandbytes"]) == {"source", "spec", "note"}
    assert set(data["llama_cpp"]) == {"backend", "how", "package", "index_url", "cmake_args"}
    assert data["device"]["arch"] == "sm_89"
    assert data["os"] == os_name and data["family"] == "Ada"
    assert all(set(advice) == {"message", "fix"} for advice in data["warnings"])
