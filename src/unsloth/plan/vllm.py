"""Step 4 (opt-in): vLLM, when `--with vllm` asked for it. Its PyPI wheel where the matrix lists one for
this OS, CPU and torch backend, with the exact torch that wheel was built against (which then replaces
the torch step 2 chose); anywhere else a refusal that names why and what still works. Never dropped
silently: a refused vLLM stays in the plan, and `unsloth install` stops on it."""

from __future__ import annotations

from unsloth.matrix import CudaIndex, VllmRow
from unsloth.plan.model import NO_NOTES, Inputs, Notes, TorchChoice, Vllm
from unsloth.plan.versions import compute_capability, torch_spec, version_or_none
from unsloth.platform.facts import Gpu

WITH_PARTS = ("vllm",)  # the parts a user opts into with `--with`
STILL_WORKS = "GRPO and fast_inference=True run on unsloth's own fast generation path instead"
OS_NAMES = {"linux": "Linux", "wsl": "WSL", "windows": "native Windows", "macos": "macOS"}
BACKEND_NAMES = {"rocm": "ROCm (AMD)", "xpu": "Intel XPU", "mps": "Apple MPS"}
MACHINES = {"amd64": "x86_64", "x86_64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}


def machine_of(text: str | None) -> str:
    """The CPU architecture as wheel tags name it: Windows' "AMD64" and macOS' "arm64" too."""
    return MACHINES.get((text or "x86_64").lower(), (text or "").lower())


def vllm_choice(inputs: Inputs, torch: TorchChoice, device: Gpu | None, wanted: bool
                ) -> tuple[Vllm | None, TorchChoice, Notes]:
    """(vLLM's part of the plan or None when not asked, the torch to install, notes)."""
    if not wanted:
        return None, torch, NO_NOTES
    row, why = _row(inputs, torch, device)
    if row is None:
        return Vllm("none", note=f"--with vllm is refused: {why}; {STILL_WORKS}"), torch, NO_NOTES
    version = row.spec.split("==", 1)[-1]
    pinned = TorchChoice(torch.backend, row.variant, _index_url(inputs, row), torch_spec(row.torch),
                         ["torch", *row.torch_packages])
    if (pinned.variant, pinned.version_spec) == (torch.variant, torch.version_spec):
        note = f"vLLM {version} is built against {pinned.version_spec} ({row.variant}), which the plan installs"
    else:
        note = (f"vLLM {version} is built against {pinned.version_spec} ({row.variant}): the plan installs that torch "
                f"in place of {torch.version_spec or 'torch'} ({torch.variant})")
    return Vllm("pypi", row.spec, pinned.version_spec, row.python, note), pinned, NO_NOTES.cite(row.source)


def _index_url(inputs: Inputs, row: VllmRow) -> str:
    pinned = inputs.pins.torch_index_url  # a mirror of the index, checked in _row to serve the same build
    return pinned or f"{inputs.pytorch}/{row.variant}"


def _row(inputs: Inputs, torch: TorchChoice, device: Gpu | None) -> tuple[VllmRow | None, str]:
    """The matrix row that serves this machine, or None and why none does."""
    rows = inputs.matrix.vllm
    on_os = [row for row in rows if inputs.os in row.oses]
    if not on_os:
        where = sorted({OS_NAMES[os] for row in rows for os in row.oses}, key=list(OS_NAMES.values()).index)
        only = f" (only for {' and '.join(where)})" if where else ""
        return None, f"vLLM publishes no wheel for {OS_NAMES.get(inputs.os, inputs.os)}{only}"
    if device is None or torch.backend == "cpu":
        kinds = "/".join(sorted({row.backend.upper() for row in on_os}))
        return None, f"vLLM's wheels need a {kinds} GPU, and this machine has none it can train on (the plan is CPU)"
    for_backend = [row for row in on_os if row.backend == torch.backend]
    if not for_backend:
        return None, f"vLLM publishes no {BACKEND_NAMES.get(torch.backend, torch.backend)} wheel (its wheels are CUDA builds)"
    machine = machine_of(inputs.platform.machine)
    row = next((row for row in for_backend if machine in row.machines), None)
    if row is None:
        machines = sorted({m for r in for_backend for m in r.machines})
        return None, f"vLLM publishes no wheel for {machine} CPUs (only {', '.join(machines)})"
    index = next(i for i in inputs.matrix.cuda_indexes if i.variant == row.variant)  # the matrix checks it is one
    why = _cuda_misfit(inputs, index, device)
    if why:
        return None, why
    pinned = inputs.pins.torch_index_url
    leaf = pinned.rstrip("/").rsplit("/", 1)[-1] if pinned else None
    if leaf and leaf != row.variant:
        return None, (f"UNSLOTH_TORCH_INDEX_URL pins a {leaf} PyTorch, but vLLM's wheel is built against "
                      f"torch{row.torch} from {row.variant}")
    return row, ""


def _cuda_misfit(inputs: Inputs, index: CudaIndex, gpu: Gpu) -> str:
    """Why vLLM's CUDA build cannot run on this GPU and driver; "" when it can (or a fact is unknown)."""
    cc = compute_capability(gpu)
    if cc is not None and not index.covers(cc):
        return (f"vLLM's wheels are CUDA {index.cuda} builds ({index.variant}), which do not cover compute capability "
                f"{cc} ({gpu.name}; {index.sm[0]} to {index.sm[1]})")
    column = "linux" if inputs.os == "linux" else "windows"  # WSL reports the Windows host driver
    driver = version_or_none(inputs.platform.nvidia_driver)
    if driver is not None and driver < index.driver[column]:
        return (f"vLLM's wheels are CUDA {index.cuda} builds, and NVIDIA driver {inputs.platform.nvidia_driver} is "
                f"older than the {index.driver[column]} they need (update the driver to use vLLM)")
    return ""
