"""Properties every plan keeps, whatever the machine: generated platforms, no hand-picked cases."""

from __future__ import annotations

from urllib.parse import urlparse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unsloth.plan import resolve
from unsloth.platform.facts import Gpu, Platform

NVIDIA_ARCHS = ["sm_37", "sm_52", "sm_61", "sm_70", "sm_75", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", None]
AMD_ARCHS = [
    "gfx906",
    "gfx908",
    "gfx90a",
    "gfx942",
    "gfx950",
    "gfx1012",
    "gfx1030",
    "gfx1031",
    "gfx1036",
    "gfx1100",
    "gfx1103",
    "gfx1151",
    "gfx1152",
    "gfx1201",
    "gfx9999",
    None,
]

gpus = st.one_of(
    st.builds(
        Gpu,
        vendor=st.just("nvidia"),
        arch=st.sampled_from(NVIDIA_ARCHS),
        integrated=st.booleans() | st.none(),
        vram_bytes=st.integers(0, 200 * 2**30) | st.none(),
        index=st.integers(0, 7) | st.none(),
    ),
    st.builds(
        Gpu,
        vendor=st.just("amd"),
        arch=st.sampled_from(AMD_ARCHS),
        integrated=st.booleans() | st.none(),
        vram_bytes=st.integers(0, 200 * 2**30) | st.none(),
        index=st.integers(0, 7) | st.none(),
    ),
    st.builds(Gpu, vendor=st.sampled_from(["intel", "apple"]), integrated=st.booleans() | st.none()),
)
versions = st.sampled_from(
    [None, "470.182.03", "525.60.13", "531.29", "560.35.03", "580.65.06", "610.43.02", "garbage"]
)
platforms = st.builds(
    Platform,
    os=st.sampled_from(["linux", "windows", "macos", None]),
    wsl=st.booleans() | st.none(),
    machine=st.sampled_from(["x86_64", "aarch64", "arm64", "AMD64", None]),
    nvidia_driver=versions,
    cuda_driver=st.sampled_from([None, "11.4", "12.1", "12.4", "12.8", "13.0", "ERR!"]),
    rocm_version=st.sampled_from([None, "5.7.1", "6.3.3", "6.4.1", "7.1.0", "7.2.53211", "10.0.0"]),
    gpus=st.lists(gpus, max_size=4),
    hsa_override=st.sampled_from([None, "10.3.0", "11.0.0", "11.5.1"]),
    hsa_override_spoofs=st.booleans() | st.none(),
    dev_kfd=st.booleans() | st.none(),
    dev_dxg=st.booleans() | st.none(),
    ram_bytes=st.integers(2**30, 512 * 2**30) | st.none(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(platform=platforms)
def test_plan_invariants(matrix, platform):
    plan = resolve(platform, matrix)

    assert plan.support in ("full", "limited", "unsupported") and plan.reason
    assert plan.device is None or any(plan.device is gpu for gpu in platform.gpus)
    assert urlparse(plan.torch.index_url).scheme == "https"
    vendor = {"cuda": "nvidia", "rocm": "amd", "mps": "apple"}.get(plan.torch.backend)
    if plan.torch.backend == "cpu":
        assert plan.device is None and plan.support != "full"
    elif plan.device is not None:
        assert plan.device.vendor == vendor
    if plan.os in ("windows", "macos"):
        assert not any(name.startswith("HSA_") for name in plan.env)
    if "HSA_OVERRIDE_GFX_VERSION" in plan.env:
        assert plan.device.arch in ("gfx1031", "gfx1036", "gfx1103")  # only archs no index ships
    if plan.bitsandbytes.source == "none":
        assert plan.fits.qlora_max_b is None
    assert all(advice.message and advice.fix for advice in plan.warnings)
    assert plan.to_json()["torch"]["backend"] == plan.torch.backend
