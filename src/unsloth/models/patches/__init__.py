"""Patch registry: the generic fast path for every decoder, then per-family kernels on top.

Every patch is found and checked by behaviour (the module's own output on a probe input), never
by copying library source, so it holds across transformers releases: a module that stops
matching simply stays unpatched.

Any causal LM transformers loads gets the generic fast path first: the fused linear cross-entropy
on its LM head (here), windowed vision attention batched by window length in a vision tower
(vision_attention.py) and the LoRA fast path on every adapted nn.Linear (`patch_peft_model`);
the loader adds our offloaded gradient checkpointing on its decoder layers and the input-embedding
offload. Families in FAMILIES (and MOE_FAMILIES) also get their norms, RoPE and gated MLP (and
experts) through our kernels.
UNSLOTH_FAMILY_PATCHES=0 keeps a model on the generic path (to compare, or to rule patches out).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from torch import nn

from unsloth.models.kernels import unavailable_reason
from unsloth.models.patches.delta_rule import route_delta_rule
from unsloth.models.patches.loss import patch_loss
from unsloth.models.patches.mlp import patch_mlps
from unsloth.models.patches.moe import patch_moe_experts
from unsloth.models.patches.norms import patch_rms_norms
from unsloth.models.patches.probe import module_device_dtype
from unsloth.models.patches.rope import patch_rope
from unsloth.models.patches.vision_attention import patch_vision_attention

log = logging.getLogger("unsloth")

# model_type -> the family patches it gets on top of the generic path.
ALL = ("rms_norm", "rope", "mlp")
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ALL,
    "mistral": ALL,
    "qwen2": ALL,
    "qwen3": ALL,
    "gemma": ALL,
    "gemma2": ALL,
    "gemma3_text": ALL,
    # Qwen3.5: norms, MLPs and the full-attention layers' projections through ours; its Gated DeltaNet
    # layers run transformers' own path, which uses flash-linear-attention and causal-conv1d where
    # installed (the gated RMSNorm inside them takes a gate, so the norm patch leaves it alone).
    "qwen3_5_text": ALL,
    "qwen3_5": ALL,
    # Gemma 4: norms and MLPs (its RoPE is applied to q and k in separate calls: stock); per-layer
    # input embeddings go through our checkpoint as layer arguments, softcapping into the fused loss.
    "gemma4_text": ALL,
    "gemma4": ALL,
    # Gemma 3n: norms and MLPs, less the first layers' activation-sparse (top-k) MLPs, which the probe
    # leaves stock, as it does the RoPE; AltUp, LAuReL and the per-layer inputs run stock.
    "gemma3n_text": ALL,
    "gemma3n": ALL,
    # Llama 3.2 / 3.3 are "llama". Phi-4 (phi3): fused qkv and gate_up projections, the MLP through
    # the fused-layout patch; its partial rotary (Phi-4-mini rotates 3/4 of each head) through our RoPE.
    "phi3": ALL,
    "mistral3": ALL,  # Mistral 3 / Ministral 3: the text model inside (mistral or ministral3) trains
    "ministral3": ALL,
    "ministral": ALL,
    "smollm3": ALL,  # its NoPE layers never call RoPE
    # OLMo 2 / 3: q/k norms over all heads and norms after attention and MLP: all RMSNorms
    "olmo2": ALL,
    "olmo3": ALL,
    "granite": ALL,  # its embedding, attention, residual and logits multipliers stay in stock code
    # Granite 4: dense when num_local_experts=0 (the shared MLP is the fused layout); Mamba layers
    # and experts of the hybrid variants run stock
    "granitemoehybrid": ALL,
    # GLM-4 dense and GLM: the MLP is the fused layout; their RoPE is interleaved and partial, which our
    # kernel does not reproduce, so it stays stock (the probe says so)
    "glm4": ALL,
    "glm": ALL,
    # Vision-language models: the patches go into their language model (`text_part`), and the norms
    # and gated MLPs into the vision tower and projector (`vision_towers`: Qwen2.5-VL's and Gemma 4's
    # towers have them, where the probes pass); the windowed attention is the generic path's
    # (`patch_vision_attention`, any model). Qwen2.5-VL / Qwen3-VL build their 3-D (multimodal)
    # cos/sin tables first and rotate with the plain apply_rotary_pos_emb, which our RoPE kernel takes.
    "qwen2_5_vl": ALL,
    "qwen3_vl": ALL,
    "gemma3": ALL,
    "mllama": ALL,
    # Sesame CSM: a Llama backbone and a Llama depth decoder (`text_parts`); its Mimi codec runs stock.
    "csm": ALL,
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
    # Llama 4 text: complex-valued RoPE (stock); its MoE blocks run every expert over every token
    # with the inputs scaled by the scores, which the patch turns into top-k routing
    "llama4_text": MOE_NO_ROPE,
    "llama4": MOE_NO_ROPE,
}

# Families whose decoder layer adds the MLP's output straight to the residual stream, with no norm
# after it (Gemma 2 and 3 have one): a checkpoint's recompute pass never reads that output, so the
# fused MLP skips its down projection there. tests/models checks each family's gradients with it.
# Granite's multiplier scales the output before the residual, which needs no value in backward. Not
# OLMo 2/3 and GLM-4 (a norm after the MLP); Phi-4, GLM and Granite 4 fuse gate and up in one
# projection, so their MLP is not on the LoRA MLP kernel this flag tunes.
MLP_FEEDS_RESIDUAL = {"llama", "mistral", "qwen2", "qwen3", "gemma", "qwen3_5_text", "qwen3_5",
                      "mistral3", "ministral3", "ministral", "smollm3", "granite",
                      "qwen2_5_vl", "qwen3_vl"}  # their language models, and Qwen2.5-VL's vision blocks


def family_patches(family: str) -> tuple[str, ...] | None:
    """The family patches `family` gets (the MoE registry's first: a superset, e.g. Gemma 4's MoE
    variant shares gemma4_text with the dense one, whose MLPs have no packed experts to find)."""
    return MOE_FAMILIES.get(family) or FAMILIES.get(family)


def family_patches_enabled() -> bool:
    return os.environ.get("UNSLOTH_FAMILY_PATCHES", "1") != "0"


@dataclass
class PatchReport:
    """What runs through our code in one model (counts of modules), and why the rest does not."""

    family: str
    rms_norm: int = 0
    rope: int = 0
    mlp: int = 0
    moe: int = 0
    moe_4bit: int = 0  # packed expert stacks held in NF4 (QLoRA of the experts)
    vision_attention: int = 0  # vision-tower attentions whose equal windows run as one batch
    vision_rms_norm: int = 0  # the vision tower's and projector's norms and gated MLPs (Qwen2.5-VL's)
    vision_mlp: int = 0
    loss: bool = False
    lora: dict[str, int] = field(default_factory=dict)
    lora_on_peft: int = 0  # LoRA layers whose base weight our kernels cannot read (8-bit): peft's forward
    checkpointed: int | None = None  # decoder layers under our checkpointing; None: not applied yet
    offloaded: bool = False  # checkpointed layers' inputs go to host memory
    embedding: str | None = None  # "host memory", or why the input embedding stays on the GPU
    delta_rule: tuple[str, bool] | None = None  # Gated DeltaNet layers: what runs them, and if it is fast
    skipped: str | None = None  # why nothing at all is patched (kernels unavailable)
    generic_only: str | None = None  # why the family patches were not applied
    said: str | None = field(default=None, repr=False, compare=False)  # the summary logged last

    def say(self) -> None:
        """Log the summary (the load message), unless it is the one logged last: loading and then adding
        LoRA each say it, and where LoRA changes nothing it would be the same line twice."""
        summary = self.summary()
        if summary != self.said:
            self.said = summary
            log.info(summary)

    def fast(self) -> list[str]:
        parts = []
        if self.rms_norm:
            parts.append(f"{self.rms_norm} RMSNorm")
        if self.rope:
            parts.append(f"{self.rope} RoPE")
        if self.mlp:
            parts.append(f"{self.mlp} MLP")
        if self.moe:
            parts.append(f"{self.moe} MoE experts" + (f" ({self.moe_4bit} stacks in NF4)" if self.moe_4bit else ""))
        if self.vision_attention:
            parts.append(f"{self.vision_attention} vision attention (windows batched)")
        if self.vision_rms_norm:
            parts.append(f"{self.vision_rms_norm} vision RMSNorm")
        if self.vision_mlp:
            parts.append(f"{self.vision_mlp} vision MLP")
        if self.loss:
            parts.append("fused loss")
        parts += [f"{n} LoRA {kind}" for kind, n in self.lora.items() if n]
        if self.checkpointed:
            parts.append(f"checkpointing on {self.checkpointed} layers" + (" (offloaded)" if self.offloaded else ""))
        if self.embedding == "host memory":
            parts.append("input embedding in host memory")
        if self.delta_rule and self.delta_rule[1]:
            parts.append(f"Gated DeltaNet through {self.delta_rule[0]}")
        return parts

    def slow(self) -> list[str]:
        parts = []
        if self.generic_only:
            parts.append(f"norms, RoPE, MLP stock ({self.generic_only})")
        else:
            parts += [f"{name} stock" for name, n in (("RMSNorm", self.rms_norm), ("RoPE", self.rope),
                                                      ("MLP", self.mlp)) if not n]  # fmt: skip
        if not self.loss:
            parts.append("loss stock (logits built)")
        if self.lora_on_peft:
            parts.append(f"{self.lora_on_peft} LoRA layers on 8-bit weights through peft + bitsandbytes "
                         "(our LoRA kernels read 16-bit and 4-bit weights)")
        if self.checkpointed == 0:
            parts.append("no checkpointing")
        if self.embedding not in (None, "host memory"):
            parts.append(f"input embedding on the GPU ({self.embedding})")
        if self.delta_rule and not self.delta_rule[1]:
            parts.append(f"Gated DeltaNet through {self.delta_rule[0]}")
        return parts

    def summary(self) -> str:
        if self.skipped:
            return f"unsloth: {self.family}: unpatched ({self.skipped}); LoRA/QLoRA train through transformers + peft"
        path = "generic fast path" if self.generic_only else "family patches"
        text = f"unsloth: {self.family}: {path}; fast: " + (", ".join(self.fast()) or "nothing")
        slow = self.slow()
        return text + ("; not accelerated: " + ", ".join(slow) if slow else "")


def text_part(model: nn.Module) -> nn.Module:
    """The language model inside a vision-language model (`model.model.language_model` in
    transformers), else the model itself."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", None) or getattr(model, "language_model", None) or model


def text_parts(model: nn.Module) -> list[nn.Module]:
    """Where the family patches go: a vision-language model's language model; a speech model's
    parts other than its audio codec (CSM: backbone and depth decoder); else the whole model."""
    from unsloth.models.speech import codec_of, outside_codec

    return outside_codec(model) if codec_of(model) is not None else [text_part(model)]


def vision_towers(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision tower and projector (outermost modules so named), where its
    norms and gated MLPs get the family's patches too: the probes decide, as in the language model."""
    from unsloth.models.vision import is_vision_module

    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and is_vision_module(name) and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return [module for _, module in found]


def patch_model(model: nn.Module) -> PatchReport:
    """Put our kernels into a loaded causal LM (before LoRA); returns what was done. The family
    patches go into its `text_parts`; the loss is the whole model's."""
    family = getattr(model.config, "model_type", type(model).__name__)
    report = PatchReport(family)
    wanted = family_patches(family)
    device, dtype = module_device_dtype(model)
    report.delta_rule = route_delta_rule(model)  # even unpatched: fla's refusal would stop the first backward
    if unavailable_reason(device) is not None:
        report.skipped = f"kernels off: {unavailable_reason(device)}"
        model._unsloth_patches = report
        report.say()
        return report
    report.loss = patch_loss(model, device)  # the generic path first
    report.vision_attention = patch_vision_attention(model, device, dtype)
    if wanted is None:
        report.generic_only = f"no family patches for {family} yet"
    elif not family_patches_enabled():
        report.generic_only = "family patches off: UNSLOTH_FAMILY_PATCHES=0"
    else:
        feeds_residual = family in MLP_FEEDS_RESIDUAL
        for text in text_parts(model):
            if "rms_norm" in wanted:
                report.rms_norm += patch_rms_norms(text)
            if "rope" in wanted:
                report.rope += patch_rope(text, device, dtype)
            if "mlp" in wanted:
                report.mlp += patch_mlps(text, device, dtype, feeds_residual)
            if "moe" in wanted:
                report.moe += patch_moe_experts(text, device, dtype)
        for tower in vision_towers(model):
            if "rms_norm" in wanted:
                report.vision_rms_norm += patch_rms_norms(tower)
            if "mlp" in wanted:
                report.vision_mlp += patch_mlps(tower, device, dtype)  # the registry speaks for language models
    model._unsloth_patches = report
    report.say()
    return report


def patch_peft_model(model) -> PatchReport | None:
    """After get_peft_model: route eligible LoRA layers through our fused LoRA kernels (any family)."""
    from peft.tuners.lora import LoraLayer

    from unsloth.models.patches.lora import kernel_reads_base, patch_lora
    from unsloth.models.patches.moe import patch_moe_lora

    base = model.get_base_model()
    report = getattr(base, "_unsloth_patches", None)
    if report is None or report.skipped:
        return report
    feeds_residual = report.generic_only is None and report.family in MLP_FEEDS_RESIDUAL
    report.lora = patch_lora(model, mlp_feeds_residual=feeds_residual)
    report.lora_on_peft = sum(isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), nn.Linear)
                              and not kernel_reads_base(m) for m in model.modules())
    wanted = (family_patches(report.family) or ()) if report.generic_only is None else ()
    if "moe" in wanted:
        report.lora["MoE experts"] = patch_moe_lora(model)
    return report
