"""Decoding a batch through bitsandbytes 4-bit layers without dequantizing their weights.

For more than one row, bitsandbytes' `matmul_4bit` dequantizes the whole weight to 16 bits and then
multiplies, so a decode step at batch 8 writes and reads back four times the packed bytes of every
layer (one row goes through its own gemv kernel instead). `install(backbone)` (what fast generation
does on a GPU) gives each 4-bit layer a forward that sends 2 to SMALL_M rows without gradients
through our fused kernel (unsloth_kernels.nf4.nf4_matmul_small): the packed bytes are read once and
dequantized in registers, as bitsandbytes' own dequantization computes them. Everything else (the
prompt, training, one row) still takes bitsandbytes' path.

The kernel is a torch custom op, so the compiled decode step captures it in its CUDA graphs.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from unsloth.models.kernels import unavailable_reason

_LAYERS = ("Linear4bit", "LinearNF4", "LinearFP4")
_FORWARD = "_unsloth_decode_4bit"  # the layer's prepared weight; its presence marks an installed layer


@torch.library.custom_op("unsloth::nf4_matmul_small", mutates_args=())
def nf4_matmul_small_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    code: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    out_features: int,
    blocksize: int,
    blocksize2: int,
    nested: bool,
) -> torch.Tensor:
    from unsloth_kernels.nf4 import Prepared4bit, nf4_matmul_small

    shape = (out_features, x.shape[-1])
    return nf4_matmul_small(x, Prepared4bit(packed, scales, code, absmax2, code2, offset, shape, blocksize,
                                            blocksize2, nested))  # fmt: skip


@nf4_matmul_small_op.register_fake
def _(x, packed, scales, code, absmax2, code2, offset, out_features, blocksize, blocksize2, nested):
    return x.new_empty((*x.shape[:-1], out_features))


def _prepared(layer: nn.Module):
    """The layer's weight in the kernel's form, or None when the kernel cannot take it."""
    from unsloth_kernels.nf4 import prepare_bnb_4bit

    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or len(getattr(state, "shape", ())) != 2 or state.shape[1] % state.blocksize:
        return None
    try:
        p = prepare_bnb_4bit(weight.data, state)
    except ValueError:
        return None
    offset = p.offset if isinstance(p.offset, torch.Tensor) else torch.full((1,), float(p.offset), device=p.data.device)
    return p, offset, state.dtype


def _decode_forward(self, x: torch.Tensor, *args, **kwargs):
    from unsloth_kernels.nf4 import SMALL_M

    p, offset, dtype = self.__dict__[_FORWARD]
    rows = x.numel() // x.shape[-1]
    if args or kwargs or torch.is_grad_enabled() or not 2 <= rows <= SMALL_M or dtype not in (torch.bfloat16, torch.float16):
        return type(self).forward(self, x, *args, **kwargs)
    y = torch.ops.unsloth.nf4_matmul_small(x.to(dtype), p.data, p.scales, p.code, p.absmax2, p.code2, offset,
                                           p.shape[0], p.blocksize, p.blocksize2, p.nested)  # fmt: skip
    if self.bias is not None:
        y = y + self.bias.to(dtype)
    return y.to(x.dtype)


def install(backbone: nn.Module, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Give the model's 4-bit layers the small-batch decode forward (on `devices` where our kernels
    run: a GPU; tests add the CPU under Triton's interpreter); returns how many layers have it.
    Idempotent; `uninstall` undoes it."""
    count = 0
    for module in backbone.modules():
        # bitsandbytes' own layers (peft's LoRA wrapper of one is also named Linear4bit)
        if not type(module).__module__.startswith("bitsandbytes") or type(module).__name__ not in _LAYERS:
            continue
        if _FORWARD in module.__dict__:
            count += 1
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.device.type not in devices or unavailable_reason(weight.device) is not None:
            continue
        prepared = _prepared(module)
        if prepared is None:
            continue
        module.__dict__[_FORWARD] = prepared
        module.forward = types.MethodType(_decode_forward, module)
        count += 1
    return count


def uninstall(backbone: nn.Module) -> None:
    for module in backbone.modules():
        if module.__dict__.pop(_FORWARD, None) is not None:
            module.__dict__.pop("forward", None)
