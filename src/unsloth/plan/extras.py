"""Step 3: the extras that follow from the torch build: bitsandbytes (QLoRA) and llama.cpp (GGUF chat)."""

from __future__ import annotations

import re
from unsloth.plan.model import NO_NOTES, BitsAndBytes, Inputs, LlamaCpp, Notes, TorchChoice
from unsloth.plan.versions import compute_capability
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
