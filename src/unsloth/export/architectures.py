"""What each supported HF architecture becomes in GGUF: llama.cpp arch, metadata keys, tensor fix-ups.

One ``Architecture`` per HF ``model_type``. The generic metadata (context length, sizes, heads, RoPE,
norm epsilon) is shared; each family adds only what differs, mirroring llama.cpp's loader for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from unsloth.export.errors import ExportError


@dataclass(frozen=True)
class Architecture:
    gguf_arch: gguf.MODEL_ARCH
    # llama.cpp's llama graph applies RoPE to interleaved pairs; HF llama/mistral store Q/K for the
    # "rotate half" layout, so their rows are permuted on the way out (as convert_hf_to_gguf does).
    permute_qk: bool = False
    # Gemma's RMSNorm computes x * (1 + w); llama.cpp computes x * w, so w + 1 is stored.
    norm_offset: float = 0.0
    extra_metadata: Callable[[Any, gguf.GGUFWriter], None] | None = None

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]


def _sliding_window_layers(config: Any, writer: gguf.GGUFWriter) -> None:
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])


def _check_gemma_attention_scale(config: Any) -> None:
    # llama.cpp does not read the attention scale for Gemma 2/3: it uses 1/sqrt(head_dim), or
    # 1/sqrt(hidden/heads) for the 27B layer counts. A config that differs would export silently wrong.
    head_dim = config.head_dim
    expected = {head_dim}
    if config.num_hidden_layers in (46, 62):
        expected.add(config.hidden_size // config.num_attention_heads)
    scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim
    if scalar not in expected:
        raise ExportError(
            f"this Gemma config scales attention by query_pre_attn_scalar={scalar}, "
            f"which llama.cpp cannot represent (it assumes {sorted(expected)})",
            fix="export with query_pre_attn_scalar equal to head_dim, as the released Gemma models do",
        )


def _gemma2(config: Any, writer: gguf.GGUFWriter) -> None:
    _check_gemma_attention_scale(config)
    if config.attn_logit_softcapping:
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    _sliding_window_layers(config, writer)


def _gemma3(config: Any, writer: gguf.GGUFWriter) -> None:
    _check_gemma_attention_scale(config)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    _sliding_window_layers(config, writer)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "mistral": Architecture(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen2": Architecture(gguf.MODEL_ARCH.QWEN2),
    "qwen3": Architecture(gguf.MODEL_ARCH.QWEN3),
    "gemma": Architecture(gguf.MODEL_ARCH.GEMMA, norm_offset=1.0),
    "gemma2": Architecture(gguf.MODEL_ARCH.GEMMA2, norm_offset=1.0, extra_metadata=_gemma2),
    "gemma3_text": Architecture(gguf.MODEL_ARCH.GEMMA3, norm_offset=1.0, extra_metadata=_gemma3),
}


def architecture_for(config: Any) -> Architecture:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        hint = " (export the text model: Gemma3ForCausalLM)" if model_type == "gemma3" else ""
        raise ExportError(
            f"GGUF export does not support the {model_type!r} architecture{hint}; nothing was written",
            fix="supported: " + ", ".join(ARCHITECTURES) + ". Save the merged 16-bit model with "
            "save_pretrained_merged and convert it with llama.cpp's convert_hf_to_gguf.py",
        )
    return ARCHITECTURES[model_type]


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global-attention RoPE parameters, sliding-window ones or None), old and new config styles."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    local = None
    if "full_attention" in params:
        local = params.get("sliding_attention")
        params = dict(params["full_attention"])
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    return params, local


def write_hparams(config: Any, arch: Architecture, writer: gguf.GGUFWriter) -> None:
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    dim = head_dim(config)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(dim)

    rope, local = rope_parameters(config)
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if local and local.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", "llama3"):  # llama3 is carried by the rope_freqs tensor
        raise ExportError(
            f"RoPE scaling {rope_type!r} is not supported by the GGUF export; nothing was written",
            fix="supported RoPE types: default, linear, yarn, llama3",
        )
    if arch.extra_metadata:
        arch.extra_metadata(config, writer)


def llama3_rope_factors(config: Any) -> np.ndarray | None:
    """llama.cpp reads Llama 3.1 RoPE scaling as per-frequency factors (the ``rope_freqs`` tensor)."""
    rope, _ = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return None
    dim = head_dim(config)
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def permute_for_ggml(weight, n_head: int):
    """HF rotate-half row order -> GGML interleaved pairs, per head (rows = n_head * head_dim).

    Works on torch tensors and numpy arrays alike."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
