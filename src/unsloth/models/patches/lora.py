"""Fast LoRA paths: peft's LoRA layers run through our fused LoRA kernels when nothing else is asked of them.

A LoRA layer qualifies while it has one active adapter, no dropout, no DoRA, is not merged and
its base weight is dense or bitsandbytes 4-bit (an 8-bit base keeps peft's forward: see
`kernel_reads_base`). Then a gated MLP runs as one `lora_mlp` (the
activation recomputed in backward, not stored), and every other LoRA linear as `lora_o` (only
x and x A^T saved). The check runs on every call, so disabling adapters (as TRL does for a
reference model), merging or a mixed-adapter batch falls back to peft's own forward.

Under torch.compile (the decode step), without gradients, a LoRA layer over a bitsandbytes 4-bit base
runs as one `nf4_matmul` for 2 to 16 rows (`_lora_4bit_decode`): it multiplies by the packed weight
directly (twice bitsandbytes' speed at 8 rows on the H200) and adds the adapter's update, computed
from x A^T, before rounding, instead of a matmul and an addition after it. One row keeps peft's
forward over bitsandbytes' own 4-bit GEMV (about 10% ahead of ours there); more rows (a prompt)
dequantize the weight with our kernel (about 0.6 x bitsandbytes' time) and multiply
(`_nf4_decode_forward`, which also serves 4-bit layers without an adapter). UNSLOTH_NF4_DECODE=1
takes nf4_matmul for one row too; UNSLOTH_NF4_DECODE=0 keeps peft's and bitsandbytes' forwards.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from unsloth.models.bnb_layout import keep_4bit_layout, repacked_for_cpu
from unsloth.models.module_tree import kept
from unsloth.models.patches.mlp import KERNEL_ACTIVATION


def lora_weights(layer):
    """The kernel's view of a peft LoRA layer, or None when the fast path does not apply right now.

    The view is kept on the layer while everything it was made from is unchanged, so the kernels'
    one-time work on it (checks, the 4-bit weight's preparation) is not redone on every call. This
    runs for every projection of every forward: the modules it reads are found once per module tree
    (module_tree.kept), and each call reads the parameters out of their modules' dicts (FSDP2 swaps
    its gathered ones in there) and the adapter's settings.
    """
    from peft.tuners.lora import LoraLayer

    if not isinstance(layer, LoraLayer) or layer.merged or layer.disable_adapters:
        return None
    adapters = layer.active_adapters
    if len(adapters) != 1:
        return None
    name = adapters[0]
    modules = kept(layer, f"lora modules {name}", lambda root: _lora_modules(root, name))
    if modules is None:
        return None
    base, a_module, b_module, dropout = modules
    weight, bias = base._parameters.get("weight"), base._parameters.get("bias")
    A, B = a_module._parameters["weight"], b_module._parameters["weight"]
    # FSDP's gathered copy of a 4-bit weight is a plain tensor of the packed bytes; bitsandbytes keeps
    # the weight's quant state on the layer too.
    quant_state = getattr(weight, "quant_state", None) or base.__dict__.get("quant_state")
    scaling, dora = layer.scaling[name], layer.use_dora.get(name, False)
    fan_in_fan_out = getattr(layer, "fan_in_fan_out", False)
    # Compared by identity; moving a model keeps the parameter objects but swaps their data (and a
    # 4-bit state's absmax), so the storage is compared too.
    objects = (weight, A, B, dropout, bias, quant_state, getattr(quant_state, "absmax", None))
    values = (scaling, dora, fan_in_fan_out, weight is not None and weight.requires_grad,
              weight is not None and weight.data_ptr(), A.device, A.dtype)  # fmt: skip
    cached = layer.__dict__.get("_unsloth_lora_weights")
    if cached is not None and cached[1] == values and all(a is b for a, b in zip(cached[0], objects)):
        return cached[2]
    weights = None
    if repacked_for_cpu(quant_state):
        pass  # a layout our kernels do not read: peft's path
    elif isinstance(dropout, nn.Identity) and not dora and not fan_in_fan_out and weight is not None:
        # 4-bit, or a dense base that is frozen (not 8-bit, not itself being trained)
        if quant_state is not None or (weight.is_floating_point() and not weight.requires_grad):
            from unsloth_kernels.lora import LoraWeights

            weights = LoraWeights(weight, A, B, float(scaling), quant_state, bias)
    layer.__dict__["_unsloth_lora_weights"] = (objects, values, weights)
    return weights


def _lora_modules(layer, name: str):
    """(base layer, lora_A, lora_B, dropout) of adapter `name`, or None where the layer has no such adapter."""
    if name not in layer.lora_A:
        return None
    return layer.get_base_layer(), layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]


def kernel_reads_base(layer) -> bool:
    """Whether our LoRA kernels can read this LoRA layer's base weight: dense 16/32-bit, or bitsandbytes
    4-bit. An 8-bit (LLM.int8) base is an int8 weight plus outlier columns that only bitsandbytes'
    own matmul handles, so those layers keep peft's forward (peft calls bitsandbytes)."""
    base = layer.get_base_layer()
    weight = getattr(base, "weight", None)
    if weight is None:
        return False
    quant_state = getattr(weight, "quant_state", None) or getattr(base, "quant_state", None)
    return weight.is_floating_point() or quant_state is not None


def _lora_linear_forward(self, x, *args, **kwargs):
    from unsloth.models.kernels import compiling

    if compiling():
        return _lora_decode_forward(self, x, *args, **kwargs)
    weights = None if (args or kwargs) else lora_weights(self)
    if weights is None:
        return type(self).forward(self, x, *args, **kwargs)
    from unsloth_kernels.lora import lora_o, lora_o_forward

    from unsloth.models.checkpointing import keep_for_recompute, keeping_for_recompute, kept_for_recompute

    # Inside our checkpoint: the first pass keeps this projection's output, the recompute replays it.
    kept = kept_for_recompute(self)
    if kept is not None:
        return lora_o(x, weights, replay=kept)
    if keeping_for_recompute() and not torch.is_grad_enabled():
        y, xa = lora_o_forward(x, weights)
        keep_for_recompute(self, y, xa)
        return y
    return lora_o(x, weights)


def _lora_mlp_forward(self, x):
    from unsloth.models.kernels import compiling
    from unsloth.models.patches.mlp import _gated_mlp_forward

    if compiling():
        return _gated_mlp_forward(self, x)  # peft's projections, the activation in torch ops
    weights = [lora_weights(p) for p in (self.gate_proj, self.up_proj, self.down_proj)]
    if any(w is None for w in weights):
        return _gated_mlp_forward(self, x)
    from unsloth_kernels.lora import lora_mlp

    from unsloth.models.checkpointing import recomputing  # our checkpoint's rerun: the output goes unread

    output_needed = not (self._unsloth_mlp_feeds_residual and recomputing())
    return lora_mlp(x, *weights, activation=KERNEL_ACTIVATION[self._unsloth_act], output_needed=output_needed)


def _lora_decode_forward(self, x, *args, **kwargs):
    """A LoRA layer inside a compiled step (decoding): over a 4-bit base, one nf4_matmul that adds the
    adapter's update in its epilogue (`_lora_4bit_decode`); else peft's forward. The gated MLP's LoRA
    projections take this forward too (the MLP's kernel runs them outside compiled steps)."""
    from unsloth.models.kernels import compiling

    y = None if (args or kwargs or not compiling()) else _lora_4bit_decode(self, x)
    return type(self).forward(self, x, *args, **kwargs) if y is None else y


def _lora_4bit_decode(layer, x):
    """peft's LoRA forward over a bitsandbytes 4-bit base as one fused pass, or None where it does not
    apply: one active adapter, unmerged, no DoRA or other variant, no dropout at work, no bias on B.
    x A^T is torch's (`_rank_projection`); nf4_matmul adds scale * (x A^T) B^T to x W^T. `layer` is a
    peft LoRA layer: patch_lora installs this path on those only."""
    if layer.merged or layer.disable_adapters or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or layer.use_dora.get(name, False) or getattr(layer, "fan_in_fan_out", False):
        return None
    if getattr(layer, "lora_variant", {}).get(name) is not None:
        return None
    lora_a, lora_b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    base = layer.get_base_layer()
    if lora_b.bias is not None or (dropout.training and not isinstance(dropout, nn.Identity)):
        return None
    if not _nf4_decode_takes(base, x, fused_lora=True):
        return None
    return _nf4_decode(base, x, (_rank_projection(x, lora_a.weight), lora_b.weight, layer.scaling[name]))


def _rank_projection(x, a):
    """x A^T for a few rows, written as a product and a sum so that torch.compile can make it one reduction
    kernel, with the cast of x (peft casts x to A's dtype, fp32 for trained adapters) inside, and one
    kernel for every projection reading the same x (q, k and v; gate and up). As a matmul it was cuBLAS's
    fp32 GEMM and its split-K pass, two launches for each projection: 2.1 ms of an H100's 14.2 ms 4-bit
    decode step at batch 8 (2026-12-07)."""
    return (x.to(a.dtype).unsqueeze(-2) * a).sum(-1)


def _nf4_decode_forward(self, x, *args, **kwargs):
    """A bitsandbytes 4-bit base layer's forward (peft adds the LoRA delta after it, where
    `_lora_4bit_decode` did not take the whole layer): `_nf4_decode` inside a compiled step, else
    bitsandbytes'."""
    from unsloth.models.kernels import compiling

    takes = not (args or kwargs) and compiling() and _nf4_decode_takes(self, x, fused_lora=False)
    return _nf4_decode(self, x) if takes else type(self).forward(self, x, *args, **kwargs)


def _nf4_decode_takes(base, x, fused_lora: bool) -> bool:
    """Whether `_nf4_decode` runs a 4-bit base without gradients: our fused nf4_matmul for 2 to 16 rows
    (1 to 16 with UNSLOTH_NF4_DECODE=1) and, with no LoRA update to fuse, our dequantization then a
    matmul for more rows. Not for one row (bitsandbytes' 4-bit GEMV reads the packed weight once) nor
    with UNSLOTH_NF4_DECODE=0."""
    from unsloth_kernels.nf4_matmul import MAX_ROWS

    mode = os.environ.get("UNSLOTH_NF4_DECODE", "")
    if mode == "0" or not _is_4bit_linear(base) or not _nf4_decode_applies(base, x):
        return False
    rows = x.numel() // x.shape[-1]
    return (rows > 1 or mode == "1") and (rows <= MAX_ROWS or not fused_lora)


def _nf4_decode(base, x, lora=None):
    """A 4-bit base's x W^T (+ bias, + the LoRA update `lora` = (x A^T, B, scale)) as `_nf4_decode_takes`
    says."""
    from unsloth_kernels.nf4 import dequantize_traceable, prepare_bnb_4bit
    from unsloth_kernels.nf4_matmul import MAX_ROWS, nf4_matmul

    rows = x.numel() // x.shape[-1]
    # Prepared per call: under compile it is traced once into views of the same tensors.
    prepared = prepare_bnb_4bit(base.weight, base.weight.quant_state)
    compute = base.compute_dtype or x.dtype  # as bitsandbytes' Linear4bit: compute dtype in, input dtype out
    bias = None if base.bias is None else base.bias.to(compute)
    if rows <= MAX_ROWS:
        return nf4_matmul(x.to(compute), prepared, bias, lora=lora).to(x.dtype)
    weight = dequantize_traceable(prepared, base.weight.quant_state.dtype).to(compute)
    return torch.nn.functional.linear(x.to(compute), weight, bias).to(x.dtype)


def _nf4_decode_applies(base, x) -> bool:
    from unsloth_kernels._utils import INTERPRET

    weight = base.weight
    state = getattr(weight, "quant_state", None)
    return (state is not None and getattr(state, "quant_type", None) in ("nf4", "fp4") and len(state.shape) == 2
            and not repacked_for_cpu(state)
            and x.shape[-1] == state.shape[1] and state.shape[1] % 2 == 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (x.is_cuda or INTERPRET) and not (torch.is_grad_enabled() and x.requires_grad))  # fmt: skip


def _is_4bit_linear(module) -> bool:
    return isinstance(module, nn.Linear) and getattr(getattr(module, "weight", None), "quant_state", None) is not None


_optimizer_hook = None


def _forget_casts_after_optimizer_steps() -> None:
    """The kernels keep each LoRA parameter's cast to the compute dtype while it is unchanged; an
    optimizer may write the parameters through its own kernels (bitsandbytes' 8-bit ones) without
    bumping their version counters, so every optimizer step also says the weights are new."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from unsloth_kernels.lora import new_weights

        _optimizer_hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: new_weights())


def patch_lora(model, mlp_feeds_residual: bool = False) -> dict[str, int]:
    """Route the LoRA layers of a PeftModel through the fused kernels; returns counts per kind.

    `mlp_feeds_residual`: the family's decoder layers add the MLP output straight to the residual
    stream, so a checkpoint's recompute pass may skip computing it (see `lora_mlp(output_needed=)`).
    """
    from peft.tuners.lora import LoraLayer

    mlps = linears = 0
    in_mlp: set[int] = set()
    for module in model.modules():
        act = getattr(module, "_unsloth_act", None)  # a gated MLP our MLP patch verified
        projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if act in KERNEL_ACTIVATION and all(isinstance(p, LoraLayer) and kernel_reads_base(p) for p in projections):
            module.forward = types.MethodType(_lora_mlp_forward, module)
            module._unsloth_mlp_feeds_residual = mlp_feeds_residual
            in_mlp.update(id(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj"))
            for projection in projections:
                projection.forward = types.MethodType(_lora_decode_forward, projection)
            mlps += 1
    for module in model.modules():
        if (isinstance(module, LoraLayer) and isinstance(module.get_base_layer(), nn.Linear)
                and id(module) not in in_mlp and "forward" not in module.__dict__ and kernel_reads_base(module)):
            module.forward = types.MethodType(_lora_linear_forward, module)
            linears += 1
    keep_4bit_layout(model)
    _forget_casts_after_optimizer_steps()
    for module in model.modules():  # the 4-bit bases of every LoRA layer, in an MLP or not
        base = module.get_base_layer() if isinstance(module, LoraLayer) else None
        if base is not None and _is_4bit_linear(base) and "forward" not in base.__dict__:
            base.forward = types.MethodType(_nf4_decode_forward, base)
    return {"MLP": mlps, "linear": linears}
