"""Per-family patch registry: which of our kernels go into which model families.

Every patch is found and checked by behaviour (the module's own output on a probe input), never
by copying library source, so it holds across transformers releases: a module that stops
matching simply stays unpatched. Families outside the registry train unpatched through
transformers + peft, and we say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from unsloth.models.kernels import unavailable_reason
from unsloth.models.patches.loss import patch_loss
from unsloth.models.patches.mlp import patch_mlps
from unsloth.models.patches.moe import patch_moe_experts
from unsloth.models.patches.norms import patch_rms_norms
from unsloth.models.patches.probe import module_device_dtype
from unsloth.models.patches.rope import patch_rope

log = logging.getLogger("unsloth")

# model_type -> the patches that family gets (all of them for the decoder families we know).
ALL = ("rms_norm", "rope", "mlp", "loss", "lora")
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ALL,
    "mistral": ALL,
    "qwen2": ALL,
    "qwen3": ALL,
    "gemma": ALL,
    "gemma2": ALL,
    "gemma3_text": ALL,
}

# Mixture-of-experts families: their packed experts also run as our grouped GEMMs ("moe"); the
# other patches cover what these models share with dense ones (norms, RoPE, shared-expert MLPs).
MOE = ALL + ("moe",)
MOE_NO_ROPE = tuple(p for p in MOE if p != "rope")
MOE_FAMILIES: dict[str, tuple[str, ...]] = {
    # gpt-oss rotates with half-width cos/sin tables of its own (and keeps its attention sinks and
    # sliding window): its RoPE stays transformers' (our RoPE patch broke it on a tiny model).
    "gpt_oss": MOE_NO_ROPE,
    "qwen3_moe": MOE,
    "qwen3_5_moe_text": MOE,
    "qwen2_moe": MOE,
    "mixtral": MOE,
    "olmoe": MOE,
    "deepseek_v3": MOE,
    "glm4_moe": MOE,
    "gemma4_text": MOE_NO_ROPE,  # its RoPE patch fails on a tiny model: apply_rotary_pos_emb differs
}

# Families whose decoder layer adds the MLP's output straight to the residual stream, with no norm
# after it (Gemma 2 and 3 have one): a checkpoint's recompute pass never reads that output, so the
# fused MLP skips its down projection there. tests/models checks each family's gradients with it.
MLP_FEEDS_RESIDUAL = {"llama", "mistral", "qwen2", "qwen3", "gemma"}


@dataclass
class PatchReport:
    """What was patched in one model (counts of modules), and why not when nothing was."""

    family: str
    rms_norm: int = 0
    rope: int = 0
    mlp: int = 0
    moe: int = 0
    loss: bool = False
    lora: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None

    def summary(self) -> str:
        if self.skipped:
            return f"unsloth: {self.family}: unpatched ({self.skipped})"
        parts = [f"{self.rms_norm} RMSNorm", f"{self.rope} RoPE", f"{self.mlp} MLP",
                 "fused loss" if self.loss else "stock loss"]
        if self.moe:
            parts.insert(3, f"{self.moe} MoE experts")
        parts += [f"{n} LoRA {kind}" for kind, n in self.lora.items()]
        return f"unsloth: {self.family}: patched " + ", ".join(parts)


def patch_model(model: nn.Module) -> PatchReport:
    """Put our kernels into a loaded causal LM (before LoRA); returns what was done."""
    family = getattr(model.config, "model_type", type(model).__name__)
    report = PatchReport(family)
    wanted = FAMILIES.get(family) or MOE_FAMILIES.get(family)
    device, dtype = module_device_dtype(model)
    if wanted is None:
        report.skipped = "no kernels for this family yet; LoRA/QLoRA train through transformers + peft"
    elif unavailable_reason(device) is not None:
        report.skipped = f"kernels off: {unavailable_reason(device)}"
    else:
        if "rms_norm" in wanted:
            report.rms_norm = patch_rms_norms(model)
        if "rope" in wanted:
            report.rope = patch_rope(model, device, dtype)
        if "mlp" in wanted:
            report.mlp = patch_mlps(model, device, dtype)
        if "moe" in wanted:
            report.moe = patch_moe_experts(model, device, dtype)
        if "loss" in wanted:
            report.loss = patch_loss(model, device)
    model._unsloth_patches = report
    log.info(report.summary())
    return report


def patch_peft_model(model) -> PatchReport | None:
    """After get_peft_model: route eligible LoRA layers through our fused LoRA kernels."""
    from unsloth.models.patches.lora import patch_lora
    from unsloth.models.patches.moe import patch_moe_lora

    base = model.get_base_model()
    report = getattr(base, "_unsloth_patches", None)
    wanted = FAMILIES.get(report.family) or MOE_FAMILIES.get(report.family, ()) if report else ()
    if report is None or report.skipped or "lora" not in wanted:
        return report
    report.lora = patch_lora(model, mlp_feeds_residual=report.family in MLP_FEEDS_RESIDUAL)
    if "moe" in wanted:
        report.lora["MoE experts"] = patch_moe_lora(model)
    log.info(report.summary())
    return report
