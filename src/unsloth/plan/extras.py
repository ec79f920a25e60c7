"""Step 5: the extras that follow from the torch build: bitsandbytes (QLoRA), llama.cpp (GGUF chat) and
flash-linear-attention (Qwen3.5's linear-attention kernels)."""

from __future__ import annotations

import re

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from unsloth.plan.model import NO_NOTES, BitsAndBytes, FlashLinearAttention, Inputs, LlamaCpp, Notes, TorchChoice
from unsloth.plan.versions import compute_capability, torch_spec
from unsloth.plan.vllm import OS_NAMES
from unsloth.platform.facts import Gpu

# llama-cpp-python has no XPU (SYCL) wheel: Intel Arc runs GGUF through Vulkan.
LLAMA_BACKEND = {"cuda": "cuda", "rocm": "hip", "mps": "metal", "cpu": "cpu", "xpu": "vulkan"}


def bitsandbytes_choice(inputs: Inputs, torch: TorchChoice, device: Gpu | None,
                        effective_arch: str | None) -> tuple[BitsAndBytes, Notes]:
    if device is not None:
        cc = compute_capability(device) if torch.backend == "cuda" else None
        arch = effective_arch or device.arch
        for row in inputs.matrix.bitsandbytes:
            if row.backend != torch.backend or inputs.os not in row.oses:
                continue
            if row.sm is not None and cc is not None and not row.sm[0] <= cc <= row.sm[1]:
                continue
            if row.archs is not None and arch not in row.archs:
                continue
            if torch.backend == "rocm" and (inputs.platform.machine or "x86_64").lower() not in ("x86_64", "amd64"):
                continue  # bitsandbytes ships ROCm kernels for x86-64 only
            return BitsAndBytes("pypi", row.spec), NO_NOTES.cite(row.source)
    note = "no bitsandbytes build for this device: QLoRA (4-bit) is unavailable, LoRA 16-bit works"
    return BitsAndBytes("none", note=note), NO_NOTES


def llama_cpp_choice(inputs: Inputs, torch: TorchChoice, effective_arch: str | None) -> tuple[LlamaCpp, Notes]:
    matrix = inputs.matrix
    backend = LLAMA_BACKEND.get(torch.backend, "cpu")
    if backend == "cpu" and inputs.os != "macos" and any(g.vendor != "apple" for g in inputs.platform.gpus):
        backend = "vulkan"  # a GPU we cannot train on can still run GGUF chat through Vulkan
    row = next((r for r in matrix.llama_cpp if r.backend == backend and inputs.os in r.oses), None)
    if row is None:
        row = next(r for r in matrix.llama_cpp if r.backend == "cpu")
    arch = effective_arch or ""
    tag = row.wheel.get(torch.variant or "") or row.wheel.get(torch.backend) or row.wheel.get(backend)
    if tag and row.wheel_archs is not None and arch not in row.wheel_archs:
        tag = None  # the prebuilt wheel lacks this gfx target: build from source for it
    # "{arch}" names the gfx target; without one, drop that flag and let cmake build for the host's GPUs.
    cmake_args = row.cmake_args.replace("{arch}", arch) if arch else re.sub(r"\s*\S*\{arch\}\S*", "", row.cmake_args)
    return LlamaCpp(
        backend=row.backend,
        how="wheel" if tag else "source",
        index_url=f"{matrix.urls['llama_cpp_wheels'].rstrip('/')}/{tag}" if tag else None,
        cmake_args=cmake_args,
    ), NO_NOTES.cite(row.source)


BACKEND_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "mps": "MPS", "cpu": "CPU"}
TORCH_PATH = "our torch chunked rule runs Qwen3.5's Gated DeltaNet layers"
NO_CAUSAL_CONV1D = ("causal-conv1d is left out (PyPI has only its source, an nvcc build): transformers' torch path "
                    "runs the short convolution")


def fla_choice(inputs: Inputs, torch: TorchChoice, device: Gpu | None) -> tuple[FlashLinearAttention | None, Notes]:
    """flash-linear-attention where its Triton kernels run and are right; None when the matrix has no rows for it."""
    rows = inputs.matrix.flash_linear_attention
    if not rows:
        return None, NO_NOTES
    row = next((r for r in rows if r.backend == torch.backend and inputs.os in r.oses), None) if device else None
    if row is None:
        if device is None or all(r.backend != torch.backend for r in rows):
            why = f"its kernels are Triton GPU kernels, and this plan's PyTorch is {BACKEND_NAMES[torch.backend]}"
        else:
            why = (f"{BACKEND_NAMES[torch.backend]} PyTorch on {OS_NAMES.get(inputs.os, inputs.os)} brings no Triton "
                   "for its kernels")
        return FlashLinearAttention("none", note=f"not installed: {why}; {TORCH_PATH}"), NO_NOTES
    table = inputs.matrix.torch_triton
    # The Triton table is of CUDA (and CPU) builds; ROCm and XPU torch pin their own Triton flavours.
    triton = pinned_triton(table, torch.version_spec) if torch.backend == "cuda" else None
    cc = compute_capability(device) if torch.backend == "cuda" else None
    on_broken_gpu = row.broken_sm is not None and cc is not None and row.broken_sm[0] <= cc <= row.broken_sm[1]
    broken = row.broken_triton if on_broken_gpu else None
    notes = NO_NOTES.cite(row.source)
    if broken and triton is not None and SpecifierSet(broken).contains(triton, prereleases=True):
        note = (f"left out: on {device.name or 'this GPU'} (compute capability {cc}) its gated backward is wrong with "
                f"Triton {broken}, and {torch.version_spec or 'torch'} pins Triton {triton}; {TORCH_PATH}. "
                f"Fix: {_fla_fix(inputs, cc, triton, broken)}")
        return (FlashLinearAttention("none", note=note, triton=str(triton), broken_triton=broken),
                notes.cite(inputs.matrix.sources["torch_triton"]))
    return FlashLinearAttention("pypi", row.spec, NO_CAUSAL_CONV1D, str(triton) if triton else None, broken), notes


def _fla_fix(inputs: Inputs, cc: Version, triton: Version, broken: str) -> str:
    """The torch that brings a Triton fla is right with, and the PyTorch CUDA build that has it."""
    table, bad = inputs.matrix.torch_triton, SpecifierSet(broken)
    fixed = [release for release in sorted(table) if table[release] > triton and not bad.contains(table[release], prereleases=True)]
    if not fixed:
        return f"a torch whose Triton is outside {broken}"
    fix = f"torch {fixed[0]} or newer (Triton {table[fixed[0]]})"
    column = "linux" if inputs.os == "linux" else "windows"  # WSL reports the Windows host driver
    for index in inputs.matrix.cuda_indexes:
        its = pinned_triton(table, torch_spec(index.torch))
        if index.covers(cc) and its is not None and not bad.contains(its, prereleases=True):
            return f"{fix}, as PyTorch's {index.variant} build has (NVIDIA driver {index.driver[column]} or newer)"
    return fix


def pinned_triton(table: dict[Version, Version], version_spec: str | None) -> Version | None:
    """The Triton the torch that ``version_spec`` ("torch>=2.9,<2.14") installs pins: that of the newest
    release it admits, as uv picks. None when unknown: no listed release fits, or it admits one newer
    than the table knows."""
    if not table:
        return None
    spec = Requirement(version_spec).specifier if version_spec else SpecifierSet()
    newest = max(table)
    beyond = (Version(f"{newest.major}.{newest.minor}.{newest.micro + 1}"), Version(f"{newest.major}.{newest.minor + 1}.0"),
              Version(f"{newest.major + 1}.0.0"))
    if any(spec.contains(version) for version in beyond):
        return None
    admitted = [release for release in table if spec.contains(release)]
    return table[max(admitted)] if admitted else None
