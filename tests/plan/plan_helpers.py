"""Builders for the Platforms the plan tests resolve: one line per machine, real-looking facts."""

from __future__ import annotations

from unsloth.platform.facts import Gpu, Platform

GIB = 2**30

# Current drivers on each side, so a test that is not about drivers gets the newest CUDA build.
NEW_LINUX_DRIVER = ("580.65.06", "13.0")
NEW_WINDOWS_DRIVER = ("581.57", "13.0")


def nvidia(
    arch: str, *, name: str | None = None, vram_gib: float = 24, integrated: bool = False, index: int | None = None
) -> Gpu:
    return Gpu(
        "nvidia",
        name=name or f"NVIDIA {arch}",
        arch=arch,
        vram_bytes=int(vram_gib * GIB),
        integrated=integrated,
        index=index,
    )


def amd(
    arch: str | None,
    *,
    name: str | None = None,
    vram_gib: float = 16,
    integrated: bool = False,
    index: int | None = None,
) -> Gpu:
    return Gpu(
        "amd", name=name or f"AMD {arch}", arch=arch, vram_bytes=int(vram_gib * GIB), integrated=integrated, index=index
    )


def machine(os_cell: str, *gpus: Gpu, **facts) -> Platform:
    """A Platform for a matrix OS cell ("linux" | "wsl" | "windows" | "macos") with plausible drivers."""
    platform = Platform(
        os="linux" if os_cell == "wsl" else os_cell,
        wsl=os_cell == "wsl",
        machine="x86_64",
        ram_bytes=32 * GIB,
        gpus=list(gpus),
    )
    if any(gpu.vendor == "nvidia" for gpu in gpus) and os_cell != "macos":
        platform.nvidia_driver, platform.cuda_driver = NEW_LINUX_DRIVER if os_cell == "linux" else NEW_WINDOWS_DRIVER
    if any(gpu.vendor == "amd" for gpu in gpus) and os_cell in ("linux", "wsl"):
        platform.rocm_version = "7.2.1"
        platform.dev_kfd = os_cell == "linux"
        platform.dev_dxg = os_cell == "wsl"
    for key, value in facts.items():
        setattr(platform, key, value)
    return platform
