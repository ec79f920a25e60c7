"""Platform x hardware matrix -> Plan: what to install and how, and how well it is supported. Pure.

`resolve` reads no files, runs nothing and looks at no environment: detection gives the Platform,
`unsloth.matrix.load_matrix` gives the data, and user pins arrive as `Overrides`.

It is a row of small steps that hand each other values (each returns its value and its `Notes`:
warnings and the matrix rows it cited):
  1. device.py: which GPU to train on, and what hides the others;
  2. torch_channel.py: where PyTorch comes from for it (CUDA, ROCm, AMD's wheels; CPU / MPS
     without a usable GPU), then the user's pin;
  3. runtime.py: what the runtime needs beside the wheels, and variables that mislead it;
  4. vllm.py: vLLM, only when asked for (`--with vllm`): its wheel and the exact torch it pins, which
     replaces step 2's, or the reason it is refused;
  5. extras.py: bitsandbytes, llama.cpp and flash-linear-attention for that torch build (the last
     left out where the Triton that torch pins breaks it on this GPU);
  6. fits.py: which model sizes fit in its memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from unsloth.matrix import Matrix
from unsloth.plan.device import choose_device, host_fallback
from unsloth.plan.extras import bitsandbytes_choice, fla_choice, llama_cpp_choice
from unsloth.plan.fits import fits
from unsloth.plan.model import (NO_NOTES, Advice, BitsAndBytes, FitRow, Fits, FlashLinearAttention, Inputs, LlamaCpp,
                                Overrides, Plan, TorchChoice, Vllm)
from unsloth.plan.runtime import user_env_advice
from unsloth.plan.torch_channel import apply_pins, host_torch, torch_for_device
from unsloth.plan.versions import gfx_of, os_cell, support_phrase, version_or_none
from unsloth.plan.vllm import WITH_PARTS, vllm_choice
from unsloth.platform.facts import Platform

__all__ = ["WITH_PARTS", "Advice", "BitsAndBytes", "FitRow", "Fits", "FlashLinearAttention", "LlamaCpp", "Overrides",
           "Plan", "TorchChoice", "Vllm", "gfx_of", "os_cell", "resolve", "support_phrase", "version_or_none"]


def resolve(platform: Platform, matrix: Matrix, *, overrides: Overrides | Mapping[str, str] | None = None,
            with_parts: Iterable[str] = ()) -> Plan:
    """Decide what to install for this platform, and say how well it is supported and why.

    ``with_parts``: the opt-in parts the user asked for (`--with`, of WITH_PARTS)."""
    pins = overrides if isinstance(overrides, Overrides) else Overrides(**dict(overrides or {}))
    inputs = Inputs(platform, matrix, pins, os_cell(platform),
                    pytorch=(pins.pytorch_mirror or matrix.urls["pytorch"]).rstrip("/"),
                    amd=(pins.amd_mirror or matrix.urls["amd"]).rstrip("/"))
    notes = NO_NOTES
    if platform.os not in matrix.oses:
        notes = notes.warn(
            "The operating system was not detected; planning for Linux.",
            "Run `unsloth detect` to see what the probes found.",
        )
    choice, more = choose_device(inputs)
    notes += more
    chosen = choice.chosen
    step, more = torch_for_device(inputs, chosen) if chosen else (None, NO_NOTES)
    notes += more
    if step is not None:
        device, family, cell = chosen.gpu, chosen.family, chosen.cell
        torch, env, effective_arch = step.torch, {**choice.env, **step.env}, step.effective_arch
        support, reason = cell.level, cell.reason
    else:  # no usable GPU: a CPU build (MPS on Apple silicon); nothing GPU-specific survives
        device, env, effective_arch = None, {}, None
        family, cell = host_fallback(inputs)
        torch, more = host_torch(inputs, family)
        notes += more
        support, reason = cell.level, cell.reason
        if chosen and chosen.cell.level == "unsupported":
            family, cell = chosen.family, chosen.cell
            support, reason = "unsupported", f"{chosen.label}: {cell.reason}; installing CPU PyTorch"
        elif chosen:
            reason = f"{chosen.label} cannot be used yet (see warnings); until then: {reason}"
    notes = notes.cite(cell.source)
    notes += user_env_advice(inputs, family.vendor if family else None, env, effective_arch)
    torch, more = apply_pins(inputs, torch)
    notes += more
    vllm, torch, more = vllm_choice(inputs, torch, device, "vllm" in set(with_parts))
    notes += more
    bitsandbytes, more = bitsandbytes_choice(inputs, torch, device, effective_arch)
    notes += more
    llama_cpp, more = llama_cpp_choice(inputs, torch, effective_arch)
    notes += more
    flash_linear_attention, more = fla_choice(inputs, torch, device)
    notes += more
    return Plan(
        support=support,
        reason=reason,
        device=device,
        device_reason=choice.reason,
        torch=torch,
        bitsandbytes=bitsandbytes,
        llama_cpp=llama_cpp,
        attention=matrix.attention.get(torch.backend, "sdpa"),
        env=dict(sorted(env.items())),
        warnings=list(notes.warnings),
        fits=fits(matrix, device, platform.ram_bytes, bitsandbytes.available),
        sources=list(notes.sources),
        os=inputs.os,
        family=family.name if family else None,
        vllm=vllm,
        flash_linear_attention=flash_linear_attention,
    )
