"""bitsandbytes' 4-bit layout, kept canonical and read right, around two behaviours of its CPU side
(0.50): a weight repacked for its AVX512-BF16 inference kernel, and a dequantize that misreads
shapes whose last dimension is shorter than the block."""

from __future__ import annotations

import copy

import torch
from torch import nn


def keep_4bit_layout(model: nn.Module) -> None:
    """bitsandbytes repacks a 4-bit weight into a CPU-only layout the first time an eval forward
    without gradients runs on an AVX512-BF16 CPU (and fails outright for out_features not a multiple
    of 32); our kernels (training after generating, merging, nf4_matmul) read the canonical layout,
    so every 4-bit layer is told not to."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def repacked_for_cpu(quant_state) -> bool:
    """Whether bitsandbytes repacked this weight for its CPU kernel before keep_4bit_layout could stop it."""
    return bool(getattr(quant_state, "packing_format_for_cpu", False))


def dequantize_4bit(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of the flat weight, in the state's shape: on the CPU it misreads
    a shape whose last dimension is under the block (a stack of 32-wide experts came back with errors
    four times the quantization's); the bytes are the flat weight's either way."""
    from bitsandbytes.functional import dequantize_4bit as bnb_dequantize_4bit

    flat = copy.copy(quant_state)  # shallow: the tensors are shared, only the shape differs
    flat.shape = torch.Size([quant_state.shape.numel()])
    return bnb_dequantize_4bit(packed, flat).view(quant_state.shape)
