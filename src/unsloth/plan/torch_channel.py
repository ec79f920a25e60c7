"""Step 2: where PyTorch comes from for the chosen device: a CUDA build, a ROCm build, AMD's own
wheels (Windows, and gfx targets PyTorch's ROCm builds do not ship), PyTorch's XPU build (Intel
Arc), or CPU / MPS; then the user's pin."""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.version import Version

from unsloth.matrix import CudaIndex, Family, RocmIndex
from unsloth.plan.device import Candidate
from unsloth.plan.model import NO_NOTES, Inputs, Notes, TorchChoice
from unsloth.plan.runtime import rocm_runtime
from unsloth.plan.versions import (backend_of_leaf, compute_capability, gfx_of, torch_ceiling, torch_spec,
                                   version_or_none)
from unsloth.platform.facts import Gpu


@dataclass(frozen=True)
class TorchStep:
    torch: TorchChoice
    env: dict[str, str] = field(default_factory=dict)  # what the runtime needs set (an HSA override, WSL's rows)
    effective_arch: str | None = None  # the gfx target the ROCm runtime will load kernels for


def torch_for_device(inputs: Inputs, chosen: Candidate) -> tuple[TorchStep | None, Notes]:
    """None when the device cannot be trained on (yet): the caller falls back to the host."""
    if chosen.cell.level == "unsupported":
        return None, NO_NOTES
    if chosen.gpu.vendor == "nvidia":
        torch, notes = cuda_choice(inputs, chosen.gpu)
        return (TorchStep(torch) if torch else None), notes
    if chosen.family and chosen.family.vendor == "amd":
        return amd_choice(inputs, chosen.gpu, chosen.family)
    if chosen.family and chosen.family.vendor == "intel" and inputs.matrix.xpu_torch:
        torch = TorchChoice("xpu", "xpu", f"{inputs.pytorch}/xpu", torch_spec(inputs.matrix.xpu_torch))
        return TorchStep(torch), NO_NOTES.cite(inputs.matrix.sources["xpu_wheels"])
    if chosen.family and chosen.family.vendor == "apple":
        torch, notes = host_torch(inputs, chosen.family)
        return TorchStep(torch), notes
    return None, NO_NOTES


def host_torch(inputs: Inputs, family: Family) -> tuple[TorchChoice, Notes]:
    """CPU PyTorch, or MPS on Apple silicon (from PyPI, where macOS wheels are)."""
    if inputs.os == "macos":
        if family.name != "Apple":
            return TorchChoice("cpu", None, inputs.matrix.urls["pypi"], "torch<2.3"), NO_NOTES.warn(
                "PyTorch stopped publishing Intel-Mac (x86_64) wheels after 2.2.",
                "Use an Apple-silicon Mac, Linux or Windows for training; GGUF chat still works here.",
            )
        return TorchChoice("mps", None, inputs.matrix.urls["pypi"], None), NO_NOTES
    return TorchChoice("cpu", "cpu", f"{inputs.pytorch}/cpu", None), NO_NOTES


# --- CUDA ---------------------------------------------------------------------------------------


def cuda_choice(inputs: Inputs, gpu: Gpu) -> tuple[TorchChoice | None, Notes]:
    matrix, platform = inputs.matrix, inputs.platform
    column = "linux" if inputs.os == "linux" else "windows"  # WSL reports the Windows host driver
    cc = compute_capability(gpu)
    fitting = [index for index in matrix.cuda_indexes if cc is None or index.covers(cc)]
    if not fitting:
        lowest = min(index.sm[0] for index in matrix.cuda_indexes)
        return None, NO_NOTES.warn(
            f"No PyTorch CUDA build covers compute capability {cc} ({gpu.name}); installing CPU PyTorch.",
            f"Train on a GPU of compute capability {lowest} or newer.",
        )
    driver = version_or_none(platform.nvidia_driver)
    if driver is None:
        index = fitting[0]
        notes = NO_NOTES.warn(
            f"No NVIDIA driver was detected; the planned CUDA build ({index.variant}) needs one.",
            f"Install NVIDIA driver {index.driver[column]} or newer ({matrix.urls['nvidia_driver']}), "
            "then run `unsloth doctor`.",
            check="driver",
        )
        return cuda_torch(inputs, index), notes.cite(index.source)
    usable = [index for index in fitting if driver >= index.driver[column]]
    if not usable:
        oldest = min(index.driver[column] for index in fitting)
        return None, NO_NOTES.warn(
            f"NVIDIA driver {platform.nvidia_driver} is too old for every PyTorch CUDA build for this GPU "
            f"(the minimum is {oldest} on {column}); installing CPU PyTorch instead.",
            f"Update the NVIDIA driver to {oldest} or newer ({matrix.urls['nvidia_driver']}), "
            "then re-run `unsloth install`.",
        )
    # Prefer a CUDA release the driver itself reports; minor-version compatibility runs the
    # newer 12.x builds on an older 12.x driver, but without newer PTX/JIT features. Among those,
    # the build that carries the newest torch (its Triton decides what fla can run on Hopper), then
    # the newest CUDA: a 570 driver gets cu126's torch 2.13 rather than cu128's 2.11.
    cuda_driver = version_or_none(platform.cuda_driver)
    native = [index for index in usable if cuda_driver is None or index.cuda <= cuda_driver]
    notes = NO_NOTES
    if native:
        index = max(native, key=lambda index: (torch_ceiling(index.torch), index.cuda))
    else:
        index = usable[-1]
        notes = notes.warn(
            f"The driver reports CUDA {cuda_driver}, older than {index.variant}'s CUDA {index.cuda}; "
            "it runs through CUDA minor-version compatibility.",
            f"Update the NVIDIA driver to one that reports CUDA {index.cuda} or newer "
            f"({matrix.urls['nvidia_driver']}).",
        )
    return cuda_torch(inputs, index), notes.cite(index.source)


def cuda_torch(inputs: Inputs, index: CudaIndex) -> TorchChoice:
    return TorchChoice("cuda", index.variant, f"{inputs.pytorch}/{index.variant}", torch_spec(index.torch))


# --- AMD ----------------------------------------------------------------------------------------


def amd_choice(inputs: Inputs, gpu: Gpu, family: Family) -> tuple[TorchStep | None, Notes]:
    arch = gpu.arch
    if arch is None:
        return None, NO_NOTES
    if inputs.os == "windows":
        return amd_wheels(inputs, family, arch, {})
    env, notes = rocm_runtime(inputs)
    shipped = any(arch in index.archs for index in inputs.matrix.rocm_indexes)
    override = None if shipped else family.hsa_override.get(arch)  # run a shipped sibling's kernels
    target = gfx_of(override) if override else arch
    index, more = rocm_index(inputs, target)
    notes += more
    if index is None:
        step, more = amd_wheels(inputs, family, arch, env)
        return step, notes + more
    if override:
        env = {**env, **override_env(inputs.platform.gpus, gpu, override)}
        notes = notes.cite(family.source)
    torch = TorchChoice("rocm", index.variant, f"{inputs.pytorch}/{index.variant}", torch_spec(index.torch))
    return TorchStep(torch, env, target), notes.cite(index.source)


def override_env(gpus: list[Gpu], gpu: Gpu, override: str) -> dict[str, str]:
    """HSA_OVERRIDE_GFX_VERSION changes every GPU the runtime opens: beside an AMD GPU of another
    target (an iGPU next to a dGPU) it would make that one load this one's kernels too. Then the
    per-node form, HSA_OVERRIDE_GFX_VERSION_<KFD node>, changes this GPU alone."""
    others = [g for g in gpus if g is not gpu and g.vendor == "amd" and g.arch != gpu.arch]
    if others and gpu.kfd_node is not None:
        return {f"HSA_OVERRIDE_GFX_VERSION_{gpu.kfd_node}": override}
    return {"HSA_OVERRIDE_GFX_VERSION": override}


def rocm_index(inputs: Inputs, arch: str) -> tuple[RocmIndex | None, Notes]:
    """PyTorch's ROCm build for this gfx target: the newest at or below the host's ROCm."""
    shipping = [index for index in inputs.matrix.rocm_indexes if arch in index.archs]
    if not shipping:
        return None, NO_NOTES
    host = version_or_none(inputs.platform.rocm_version)
    if host is None:
        return shipping[0], NO_NOTES
    host = Version(f"{host.major}.{host.minor}")
    at_or_below = [index for index in shipping if index.rocm <= host]
    if at_or_below:
        return at_or_below[0], NO_NOTES
    index = shipping[-1]  # the closest release above the host's ROCm
    return index, NO_NOTES.warn(
        f"ROCm {inputs.platform.rocm_version} is older than every PyTorch ROCm build for {arch}; "
        f"using {index.variant}, which expects ROCm {index.rocm} or newer.",
        f"Upgrade ROCm to {index.rocm} or newer: {inputs.matrix.urls['rocm_install']}",
    )


def amd_wheels(inputs: Inputs, family: Family, arch: str, env: dict[str, str]) -> tuple[TorchStep | None, Notes]:
    """AMD's own per-gfx-target wheels (repo.amd.com): Windows, and targets PyTorch's builds lack."""
    leaf = family.amd_index.get(arch)
    if leaf is None:
        return None, NO_NOTES.warn(
            f"No PyTorch ROCm build ships {arch} on {inputs.os}; installing CPU PyTorch.",
            "See docs/hardware-support.md for the supported gfx targets; GGUF chat still runs through Vulkan.",
        )
    torch = TorchChoice("rocm", leaf, f"{inputs.amd}/{leaf}/", torch_spec(inputs.matrix.amd_torch))
    return TorchStep(torch, env, arch), NO_NOTES.cite(inputs.matrix.sources["amd_wheels"])


# --- the user's pin -----------------------------------------------------------------------------


def apply_pins(inputs: Inputs, torch: TorchChoice) -> tuple[TorchChoice, Notes]:
    url = inputs.pins.torch_index_url
    if not url:
        return torch, NO_NOTES
    leaf = url.rstrip("/").rsplit("/", 1)[-1]
    backend = backend_of_leaf(leaf) or torch.backend
    notes = NO_NOTES
    if backend != torch.backend:
        notes = notes.warn(
            f"UNSLOTH_TORCH_INDEX_URL pins a {backend} build, "
            f"but this machine's plan is {torch.backend} ({torch.variant}).",
            f"Unset UNSLOTH_TORCH_INDEX_URL to install the {torch.variant or torch.backend} build.",
        )
    return TorchChoice(backend, leaf, url, torch.version_spec if backend == torch.backend else None,
                       torch.packages), notes
