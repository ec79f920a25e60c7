"""Every family x OS cell of the support table, resolved for a representative machine.

The expectations are written out here (not read from the matrix), so a change to the matrix that
changes what users get fails a test and has to be made on purpose."""

from __future__ import annotations

import pytest
from plan_helpers import amd, machine, nvidia

from unsloth.plan import resolve
from unsloth.platform.facts import Gpu

GPU_OSES = ("linux", "wsl", "windows")
NO_ENV: dict[str, str] = {}
DXG = {"HSA_ENABLE_DXG_DETECTION": "1"}

# family -> the GPU that stands for it
REPRESENTATIVE = {
    "Kepler": nvidia("sm_37", name="Tesla K80"),
    "Maxwell": nvidia("sm_52", name="GeForce GTX 970"),
    "Pascal": nvidia("sm_61", name="GeForce GTX 1080 Ti"),
    "Volta": nvidia("sm_70", name="Tesla V100"),
    "Turing": nvidia("sm_75", name="Tesla T4"),
    "Ampere": nvidia("sm_86", name="GeForce RTX 3090"),
    "Ada": nvidia("sm_89", name="GeForce RTX 4090"),
    "Hopper": nvidia("sm_90", name="H100"),
    "Blackwell": nvidia("sm_120", name="GeForce RTX 5090"),
    "GCN": amd("gfx702", name="Radeon R9 390"),
    "GCN5": amd("gfx906", name="Radeon VII"),
    "CDNA1": amd("gfx908", name="Instinct MI100"),
    "CDNA2": amd("gfx90a", name="Instinct MI250X"),
    "CDNA3": amd("gfx942", name="Instinct MI300X"),
    "CDNA4": amd("gfx950", name="Instinct MI355X"),
    "RDNA1": amd("gfx1010", name="Radeon RX 5700 XT"),
    "RDNA2": amd("gfx1032", name="Radeon RX 6600"),
    "RDNA3": amd("gfx1100", name="Radeon RX 7900 XTX"),
    "RDNA3.5": amd("gfx1151", name="Radeon 8060S", integrated=True),
    "RDNA4": amd("gfx1201", name="Radeon RX 9070 XT"),
    "Intel": Gpu("intel", name="Intel UHD Graphics 770", integrated=True),
    "Arc": Gpu("intel", name="Intel Arc B580", family="Arc", integrated=False),
    "Apple": Gpu("apple", name="Apple M3 Max", integrated=True),
    "CPU": None,
}

# (family, os) -> (support, torch backend, torch variant, env, bitsandbytes source, llama.cpp backend)
EXPECTED: dict[tuple[str, str], tuple] = {}
for os_name in GPU_OSES:
    for family in ("Turing", "Ampere", "Ada", "Hopper", "Blackwell"):
        EXPECTED[(family, os_name)] = ("full", "cuda", "cu130", NO_ENV, "pypi", "cuda")
    EXPECTED[("Maxwell", os_name)] = ("limited", "cuda", "cu126", NO_ENV, "none", "cuda")  # no sm_5x bnb kernels
    EXPECTED[("Pascal", os_name)] = ("limited", "cuda", "cu126", NO_ENV, "pypi", "cuda")
    EXPECTED[("Volta", os_name)] = ("limited", "cuda", "cu126", NO_ENV, "pypi", "cuda")
    EXPECTED[("Kepler", os_name)] = ("unsupported", "cpu", "cpu", NO_ENV, "none", "vulkan")
    for family in ("GCN", "GCN5", "RDNA1", "Intel"):
        EXPECTED[(family, os_name)] = ("unsupported", "cpu", "cpu", NO_ENV, "none", "vulkan")
    EXPECTED[("Apple", os_name)] = ("unsupported", "cpu", "cpu", NO_ENV, "none", "cpu")
    EXPECTED[("CPU", os_name)] = ("limited", "cpu", "cpu", NO_ENV, "none", "cpu")
for os_name in ("wsl", "windows"):
    for family in ("CDNA1", "CDNA2", "CDNA3", "CDNA4", "RDNA2"):
        EXPECTED[(family, os_name)] = ("unsupported", "cpu", "cpu", NO_ENV, "none", "vulkan")
EXPECTED.update(
    {
        ("Arc", "linux"): ("limited", "xpu", "xpu", NO_ENV, "none", "vulkan"),
        ("Arc", "windows"): ("limited", "xpu", "xpu", NO_ENV, "none", "vulkan"),
        ("Arc", "wsl"): ("unsupported", "cpu", "cpu", NO_ENV, "none", "vulkan"),
        ("CDNA1", "linux"): ("limited", "rocm", "rocm7.2", NO_ENV, "none", "hip"),
        ("CDNA2", "linux"): ("full", "rocm", "rocm7.2", NO_ENV, "pypi", "hip"),
        ("CDNA3", "linux"): ("full", "rocm", "rocm7.2", NO_ENV, "pypi", "hip"),
        ("CDNA4", "linux"): ("full", "rocm", "rocm7.2", NO_ENV, "pypi", "hip"),
        ("RDNA2", "linux"): ("limited", "rocm", "rocm7.2", {"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}, "none", "hip"),
        ("RDNA3", "linux"): ("full", "rocm", "rocm7.2", NO_ENV, "pypi", "hip"),
        ("RDNA3", "wsl"): ("full", "rocm", "rocm7.2", DXG, "pypi", "hip"),
        ("RDNA3", "windows"): ("full", "rocm", "gfx110X-all", NO_ENV, "pypi", "hip"),
        ("RDNA3.5", "linux"): ("full", "rocm", "rocm7.2", NO_ENV, "pypi", "hip"),
        ("RDNA3.5", "wsl"): ("full", "rocm", "rocm7.2", DXG, "pypi", "hip"),
        ("RDNA3.5", "windows"): ("full", "rocm", "gfx1151", NO_ENV, "pypi", "hip"),
        ("RDNA4", "linux"): ("full", "rocm", "rocm7.2", NO_ENV, "pypi", "hip"),
        ("RDNA4", "wsl"): ("full", "rocm", "rocm7.2", DXG, "pypi", "hip"),
        ("RDNA4", "windows"): ("full", "rocm", "gfx120X-all", NO_ENV, "pypi", "hip"),
        # macOS: no CUDA or ROCm; Intel Macs (x86_64) get the last CPU wheels from PyPI.
        **{(family, "macos"): ("unsupported", "cpu", None, NO_ENV, "none", "cpu") for family in REPRESENTATIVE},
        ("Apple", "macos"): ("limited", "mps", None, NO_ENV, "none", "metal"),
        ("CPU", "macos"): ("limited", "cpu", None, NO_ENV, "none", "cpu"),
    }
)


def test_every_matrix_cell_has_an_expectation(matrix):
    assert set(matrix.support) == set(EXPECTED)
    assert set(matrix.families) == set(REPRESENTATIVE)


@pytest.mark.parametrize(("family", "os_name"), sorted(EXPECTED), ids=lambda value: str(value))
def test_cell(matrix, family, os_name):
    support, backend, variant, env, bnb, llama = EXPECTED[(family, os_name)]
    gpu = REPRESENTATIVE[family]
    platform = machine(os_name, *([gpu] if gpu else []))
    if family == "Apple":
        platform.machine = "arm64"

    plan = resolve(platform, matrix)

    assert (plan.support, plan.torch.backend, plan.torch.variant) == (support, backend, variant)
    assert plan.env == env
    assert plan.bitsandbytes.source == bnb
    assert plan.llama_cpp.backend == llama
    assert plan.os == os_name
    assert plan.reason and plan.sources
    if os_name == "windows" or family not in ("RDNA2",):
        assert "HSA_OVERRIDE_GFX_VERSION" not in plan.env
    if backend == "cpu":
        assert plan.device is None
    else:
        assert plan.device is gpu and plan.family == family
