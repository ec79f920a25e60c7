"""QLoRA of packed MoE experts: their (E, ...) weight stacks quantized to NF4 on load.

bitsandbytes quantizes nn.Linear layers only, so the packed expert stacks of gpt-oss, Qwen3-MoE
and the other families in patches/moe.py (plain 3-D parameters, most of the model's weights)
would stay 16-bit under `load_in_4bit`: gpt-oss-20b QLoRA would need ~40 GB instead of ~13.
Here each stack becomes bitsandbytes' NF4 format (double-quantized absmax, blocks of 64: the
bytes our kernels read, see unsloth_kernels.nf4), held by `Nf4Stack`, a tensor subclass that
still looks like the dense stack (shape, dtype, device) to everything else:

- our MoE kernel takes its packed bytes and QuantState (patches/moe.py) and dequantizes inside;
- peft's `target_parameters` wraps it as it would the dense parameter (it reads shape, dtype and
  device), and the LoRA factors are trained on top of the frozen 4-bit stack;
- any other use (the module's stock forward, peft's own fallback, an export) sees the dequantized
  weights: every operation but views, copies and moves dequantizes first. Writing into it is an
  error, not a silent write to a temporary.

The stacks are quantized while the checkpoint loads (`quantize_experts_on_load`): transformers
materializes one tensor at a time and sets it on its module, and each dense stack is replaced by
its NF4 form as it is set, so loading peaks at about the 4-bit model plus one layer's 16-bit
stacks, not at the 16-bit model. Only experts modules the MoE patch then takes keep 4-bit stacks;
the others are dequantized back (the stock forward over a 4-bit stack is correct but dequantizes
the whole stack for each expert).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils import _pytree as pytree

log = logging.getLogger("unsloth")

aten = torch.ops.aten
EXPERT_STACKS = ("gate_up_proj", "down_proj")
BLOCKSIZE = 64  # bitsandbytes' default NF4 block, as the loader's BitsAndBytesConfig uses


def _state_on(state, device=None, dtype=None):
    """A copy of a bitsandbytes QuantState with its tensors on `device` and compute dtype `dtype`
    (QuantState.to moves in place, which would move the state of the tensor a copy came from)."""
    from bitsandbytes.functional import QuantState

    def moved(t):
        return t if t is None or device is None else t.to(device)

    state2 = None
    if state.state2 is not None:
        s2 = state.state2
        state2 = QuantState(absmax=moved(s2.absmax), code=moved(s2.code), blocksize=s2.blocksize,
                            quant_type=s2.quant_type, dtype=s2.dtype)  # fmt: skip
    offset = moved(state.offset) if isinstance(state.offset, torch.Tensor) else state.offset
    return QuantState(absmax=moved(state.absmax), shape=state.shape, code=moved(state.code), blocksize=state.blocksize,
                      quant_type=state.quant_type, dtype=dtype or state.dtype, offset=offset, state2=state2)  # fmt: skip


class Nf4Stack(torch.Tensor):
    """A weight stack stored as bitsandbytes NF4 bytes (`packed`) and their `quant_state`,
    presenting the dense stack's shape and dtype (see the module's docstring)."""

    packed: torch.Tensor
    quant_state: object

    @staticmethod
    def __new__(cls, packed: torch.Tensor, quant_state):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(quant_state.shape), dtype=quant_state.dtype,
                                                   device=packed.device, requires_grad=False)  # fmt: skip

    def __init__(self, packed: torch.Tensor, quant_state):
        self.packed, self.quant_state = packed, quant_state

    @classmethod
    def quantize(cls, dense: torch.Tensor) -> Nf4Stack:
        """bitsandbytes' double-quantized NF4 of the stack `dense`, one expert at a time: where each
        expert is a whole number of blocks, the bytes are those of one `quantize_4bit` of the whole
        stack, but its float32 working copies (several times the stack, on the CPU) are one expert's."""
        from bitsandbytes.functional import QuantState, quantize_4bit, quantize_blockwise

        dense = dense.detach().contiguous()
        options = dict(blocksize=BLOCKSIZE, quant_type="nf4", quant_storage=torch.uint8)
        if dense.dim() < 2 or dense[0].numel() % BLOCKSIZE:  # blocks would straddle two experts
            return cls(*quantize_4bit(dense, compress_statistics=True, **options))
        parts = [quantize_4bit(expert, compress_statistics=False, **options) for expert in dense]
        absmax = torch.cat([state.absmax for _, state in parts])
        offset = absmax.mean()  # the nested level, as quantize_4bit(compress_statistics=True) does it
        qabsmax, state2 = quantize_blockwise(absmax - offset, blocksize=256)
        state = QuantState(absmax=qabsmax, shape=dense.shape, dtype=dense.dtype, blocksize=BLOCKSIZE,
                           code=parts[0][1].code, quant_type="nf4", offset=offset, state2=state2)  # fmt: skip
        return cls(torch.cat([packed for packed, _ in parts]), state)

    def dequantize(self) -> torch.Tensor:
        from unsloth.models.bnb_layout import dequantize_4bit

        return dequantize_4bit(self.packed, self.quant_state)

    def nbytes_stored(self) -> int:
        """Bytes this stack holds: packed weights plus every level of its scales."""
        state = self.quant_state
        parts = [self.packed, state.absmax, state.code]
        if state.state2 is not None:
            parts += [state.state2.absmax, state.state2.code]
        return sum(t.numel() * t.element_size() for t in parts)

    def __repr__(self, *, tensor_contents=None):
        return f"Nf4Stack(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    # torch.compile / Module._apply (swap_tensors) see the inner tensors through these two
    def __tensor_flatten__(self):
        return ["packed"], {"quant_state": self.quant_state}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Nf4Stack(inner["packed"], meta["quant_state"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return cls(args[0].packed, args[0].quant_state)
        if func is aten.clone.default:
            return cls(args[0].packed.clone(), _state_on(args[0].quant_state))
        if func is aten._to_copy.default:  # .to(device / dtype): stays 4-bit; the dtype is the compute dtype
            self = args[0]
            device, dtype = kwargs.get("device"), kwargs.get("dtype")
            if dtype is None or dtype.is_floating_point:
                return cls(self.packed.to(device) if device is not None else self.packed,
                           _state_on(self.quant_state, device, dtype))  # fmt: skip
        if func._schema.is_mutable:
            raise RuntimeError(f"{func}: a 4-bit expert stack (Nf4Stack) cannot be written in place; train LoRA "
                               "adapters on it, or replace the parameter with its dequantize() to change it")  # fmt: skip
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


@contextmanager
def quantize_experts_on_load(holds_stacks: Callable[[nn.Module], bool]) -> Iterator[None]:
    """While inside, every expert stack loaded from a checkpoint is stored as an Nf4Stack the moment it
    is set on a module for which `holds_stacks` is true.

    transformers sets each loaded tensor with `setattr(module, name, Parameter)`, after marking it
    `_is_hf_initialized`; torch's parameter-registration hook sees that and returns the replacement.
    Stacks not from the checkpoint (still on the meta device, or missing and initialized later) are
    left to `quantize_packed_experts` after loading."""

    def hook(module: nn.Module, name: str, param):
        if (name not in EXPERT_STACKS or isinstance(param, Nf4Stack) or not getattr(param, "_is_hf_initialized", False)
                or param.device.type == "meta" or not param.is_floating_point() or param.dim() != 3
                or not holds_stacks(module)):  # fmt: skip
            return None
        stack = nn.Parameter(Nf4Stack.quantize(param.data), requires_grad=False)
        stack._is_hf_initialized = True  # loaded: transformers must not initialize it again
        return stack

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _experts_modules(model: nn.Module):
    for module in model.modules():
        if "_unsloth_moe" in module.__dict__:  # patched by patches/moe.patch_moe_experts
            yield module


def quantize_packed_experts(model: nn.Module) -> int:
    """Quantize the weight stacks of every patched experts module to NF4, one stack at a time (so
    only one dense stack is ever copied); returns how many stacks are now 4-bit."""
    quantized = 0
    for module in _experts_modules(model):
        for name in EXPERT_STACKS:
            param = getattr(module, name, None)
            if isinstance(param, Nf4Stack):
                quantized += 1
                continue
            if not isinstance(param, nn.Parameter) or not param.is_floating_point() or param.requires_grad:
                continue
            stack = Nf4Stack.quantize(param.data)
            setattr(module, name, nn.Parameter(stack, requires_grad=False))
            del param, stack
            quantized += 1
    if quantized and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the dense stacks' blocks
    return quantized


def expert_stack_bytes(model: nn.Module) -> int:
    """Bytes held by the packed expert stacks of the patched experts modules, as stored."""
    total = 0
    for module in _experts_modules(model):
        for name in EXPERT_STACKS:
            param = getattr(module, name, None)
            if isinstance(param, Nf4Stack):
                total += param.nbytes_stored()
            elif isinstance(param, torch.Tensor):
                total += param.numel() * param.element_size()
    return total


def dequantize_packed_experts(model: nn.Module, modules=None) -> int:
    """Turn every Nf4Stack parameter (of `modules`, by default all of `model`'s) back into a dense one
    (a merge or full fine-tuning writes into the weights); returns how many were dequantized."""
    count = 0
    for module in model.modules() if modules is None else modules:
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, Nf4Stack):
                setattr(module, name, nn.Parameter(param.dequantize(), requires_grad=False))
                count += 1
    return count
