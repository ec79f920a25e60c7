"""Step 1: which GPU to train on (one device, one torch backend), and what hides the others.

When there are several GPUs:
  1. GPUs the matrix supports on this OS beat unsupported ones, "full" beats "limited";
  2. discrete beats integrated (a laptop's dGPU over its iGPU);
  3. NVIDIA beats AMD beats others (the CUDA stack is the most complete);
  4. more VRAM wins; then the tool's own order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from unsloth.matrix import Family, SupportCell
from unsloth.plan.model import NO_NOTES, Inputs, Notes
from unsloth.plan.versions import support_phrase
from unsloth.platform.facts import Gpu

LEVEL_RANK = {"full": 2, "limited": 1, "unsupported": 0}
VENDOR_RANK = {"nvidia": 2, "amd": 1}


@dataclass(frozen=True)
class Candidate:
    gpu: Gpu
    family: Family | None
    cell: SupportCell | None
    position: int

    @property
    def label(self) -> str:
        details = ", ".join(x for x in (self.gpu.arch, self.family.name if self.family else None) if x)
        name = self.gpu.name or f"{self.gpu.vendor} GPU"
        return f"{name} ({details})" if details else name

    def rank(self) -> tuple:
        level = LEVEL_RANK[self.cell.level] if self.cell else -1
        return (
            level,
            not self.gpu.integrated,
            VENDOR_RANK.get(self.gpu.vendor, 0),
            self.gpu.vram_bytes or 0,
            -self.position,
        )


@dataclass(frozen=True)
class DeviceChoice:
    chosen: Candidate | None  # None: no usable GPU
    reason: str
    env: dict[str, str]  # what hides the GPUs not chosen from the runtime


def classify(inputs: Inputs, gpu: Gpu, position: int) -> Candidate:
    matrix = inputs.matrix
    family = matrix.families.get(gpu.family or "") or (matrix.family_of(gpu.arch) if gpu.arch else None)
    if family is None and gpu.vendor == "nvidia" and gpu.compute_capability:
        family = matrix.family_of("sm_" + gpu.compute_capability.replace(".", ""))
    if family is None:  # vendors the matrix keeps as one family without archs (Intel, Apple)
        family = next((f for f in matrix.families.values() if f.vendor == gpu.vendor and not f.archs), None)
    cell = matrix.support.get((family.name, inputs.os)) if family else None
    return Candidate(gpu, family, cell, position)


def choose_device(inputs: Inputs) -> tuple[DeviceChoice, Notes]:
    candidates = [classify(inputs, gpu, n) for n, gpu in enumerate(inputs.platform.gpus)]
    notes = NO_NOTES
    for candidate in candidates:
        if candidate.family is None and candidate.gpu.vendor == "amd":
            notes = notes.warn(
                f"{candidate.label}: the AMD GPU's gfx target could not be read, "
                "so no ROCm build can be chosen for it.",
                f"Install ROCm ({inputs.matrix.urls['rocm_install']}) so `rocminfo` can name the gfx target, "
                "then re-run `unsloth install`.",
            )
    usable = [c for c in candidates if c.family and c.cell]
    unnamed_nvidia = [c for c in candidates if c.family is None and c.gpu.vendor == "nvidia"]
    if not usable and unnamed_nvidia and inputs.platform.nvidia_driver:
        choice, more = unidentified_nvidia(inputs, unnamed_nvidia[0])
        return choice, notes + more
    if not usable:
        if candidates:
            return DeviceChoice(None, "no GPU the hardware matrix knows: " + ", ".join(c.label for c in candidates),
                                {}), notes
        return DeviceChoice(None, "no GPU detected", {}), notes
    best = max(usable, key=Candidate.rank)
    if len(candidates) == 1:
        return DeviceChoice(best, f"{best.label}: the only GPU", {}), notes
    others = [c for c in candidates if c is not best]
    peers = [o for o in others if o.gpu.vendor == best.gpu.vendor and o.cell and not o.gpu.integrated]
    if peers and inputs.os == "windows":
        notes = notes.warn(f"{len(peers) + 1} {best.gpu.vendor.upper()} GPUs, but training on several is not supported "
                           "on Windows (PyTorch has no NCCL there): one GPU trains.",
                           "For `unsloth train --gpus N`, install in WSL or Linux on this machine.")
    why = []
    for other in others:
        if other.cell is None:
            why.append(f"{other.label}: unknown to the matrix")
        elif other.cell.level != best.cell.level and LEVEL_RANK[other.cell.level] < LEVEL_RANK[best.cell.level]:
            why.append(f"{other.label}: {other.cell.level} on {inputs.os}")
        elif other.gpu.integrated and not best.gpu.integrated:
            why.append(f"{other.label}: integrated")
        elif VENDOR_RANK.get(other.gpu.vendor, 0) < VENDOR_RANK.get(best.gpu.vendor, 0):
            why.append(f"{other.label}: NVIDIA CUDA preferred over {other.gpu.vendor}")
        else:
            why.append(f"{other.label}: less VRAM or listed later")
    reason = f"{best.label}: {support_phrase(best.cell.level)}; preferred over " + "; ".join(why)
    return DeviceChoice(best, reason, hide_others(inputs, best, others)), notes


def unidentified_nvidia(inputs: Inputs, candidate: Candidate) -> tuple[DeviceChoice, Notes]:
    """A working driver but a model name that fixes no generation (nvidia-smi truncates long
    names): plan CUDA from the driver alone, as "limited" until the generation is known."""
    cell = SupportCell(
        family="NVIDIA (unidentified)",
        os=inputs.os,
        level="limited",
        reason=f"the GPU generation could not be identified from {candidate.gpu.name!r}; "
        "planned from the driver alone",
        source="nvidia-smi driver version",
    )
    notes = NO_NOTES.warn(
        f"Could not tell which NVIDIA generation {candidate.gpu.name!r} is; "
        "GPUs older than Turing need the cu126 build.",
        "Check with `nvidia-smi --query-gpu=name,compute_cap --format=csv`; for compute capability below 7.5 set "
        f"UNSLOTH_TORCH_INDEX_URL={inputs.pytorch}/cu126 and re-run `unsloth install`.",
    )
    chosen = replace(candidate, cell=cell)
    return DeviceChoice(chosen, f"{chosen.label}: the only NVIDIA GPU, generation unknown", {}), notes


def hide_others(inputs: Inputs, best: Candidate, others: list[Candidate]) -> dict[str, str]:
    """Same-vendor GPUs we did not choose would still be enumerated by the runtime: hide them."""
    same = [o for o in others if o.gpu.vendor == best.gpu.vendor]
    if not same or best.gpu.index is None or inputs.os == "windows" or inputs.os == "macos":
        return {}
    if all(o.cell and o.cell.level == best.cell.level and not o.gpu.integrated for o in same):
        return {}  # peers of the same kind: training may use them all
    if best.gpu.vendor == "nvidia":
        # CUDA_DEVICE_ORDER makes CUDA ordinals match nvidia-smi's
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(best.gpu.index)}
    if best.gpu.vendor == "amd":
        return {"HIP_VISIBLE_DEVICES": str(best.gpu.index)}
    return {}


def host_fallback(inputs: Inputs) -> tuple[Family, SupportCell]:
    """What runs without a usable GPU: MPS on Apple silicon, else the CPU."""
    apple = inputs.os == "macos" and (
        (inputs.platform.machine or "").lower() in ("arm64", "aarch64")
        or any(g.vendor == "apple" for g in inputs.platform.gpus)
    )
    family = inputs.matrix.families["Apple" if apple else "CPU"]
    return family, inputs.matrix.cell(family.name, inputs.os)
