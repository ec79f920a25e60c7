"""Gated MLP: gate/up/down projections with a SiLU or GELU gate run through our fused activation kernel.

The module keeps its projections (so LoRA wrappers on them still apply); only the
`act(gate) * up` in the middle becomes one kernel. The kind of activation is read off the
module's own activation on a probe, never off a class name. Two layouts: separate gate_proj /
up_proj / down_proj (Llama), or one projection to 2 x intermediate that is split in two, then a
down projection (Phi-3/4's gate_up_proj, GLM's, Granite 4's shared MLP): which of the two halves
is the gate is found on the probe too.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from unsloth.models.patches.probe import same

# kind -> the reference the module's act_fn must reproduce
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
KERNEL_ACTIVATION = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}  # kind -> the MLP kernels' name


def gated(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up through the fused kernel for this activation kind (torch ops under torch.compile)."""
    from unsloth_kernels.activations import geglu, swiglu

    from unsloth.models.kernels import compiling

    if compiling():
        return _ACTIVATIONS[kind](gate) * up
    if kind == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if kind == "gelu_tanh" else "none")


def activation_kind(act_fn, device, dtype) -> str | None:
    """Which gate activation `act_fn` computes, found by evaluating it."""
    x = torch.linspace(-6, 6, 257, device=device, dtype=dtype)
    with torch.no_grad():
        y = act_fn(x)
        for kind, reference in _ACTIVATIONS.items():
            if same(y, reference(x)):
                return kind
    return None


def _gated_mlp_forward(self, x):
    weights = _trained_dense_weights(self)
    if weights is not None:
        from unsloth_kernels.gated_mlp import dense_gated_mlp

        from unsloth.models.checkpointing import recomputing  # our checkpoint's rerun: the output goes unread

        output_needed = not (getattr(self, "_unsloth_mlp_feeds_residual", False) and recomputing())
        return dense_gated_mlp(x, *weights, KERNEL_ACTIVATION[self._unsloth_act], output_needed=output_needed)
    return self.down_proj(gated(self._unsloth_act, self.gate_proj(x), self.up_proj(x)))


def _trained_dense_weights(module) -> tuple[torch.Tensor, ...] | None:
    """(gate, up, down) weights when a backward will train them (full fine-tuning): three plain
    bias-free nn.Linear, at least one weight trainable, gradients on and nothing compiling."""
    from unsloth.models.kernels import compiling

    projections = (module.gate_proj, module.up_proj, module.down_proj)
    if not torch.is_grad_enabled() or compiling() or any(type(p) is not nn.Linear or p.bias is not None
                                                         for p in projections):  # fmt: skip
        return None
    weights = tuple(p.weight for p in projections)
    return weights if any(w.requires_grad for w in weights) and all(w.is_floating_point() for w in weights) else None


def _fused_gated_mlp_forward(self, x):
    gate_up, down, gate_first = self._unsloth_fused
    first, second = getattr(self, gate_up)(x).chunk(2, dim=-1)
    gate, up = (first, second) if gate_first else (second, first)
    return getattr(self, down)(gated(self._unsloth_act, gate, up))


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _in_features(projection: nn.Module) -> int | None:
    """The input width of a projection: a Linear, or a wrapper around one (Gemma 4's vision tower clips
    its Linear's inputs and outputs)."""
    linear = next((m for m in projection.modules() if isinstance(m, nn.Linear)), None)
    return None if linear is None else linear.in_features


def _fused_layout(module: nn.Module) -> tuple[str, str] | None:
    """(gate_up, down) names when the module's only Linear children are one projection to twice the
    width the other projects back from: the fused gate/up layout."""
    linears = [(name, child) for name, child in module.named_children() if isinstance(child, nn.Linear)]
    if len(linears) != 2:
        return None
    for (a, first), (b, second) in (linears, linears[::-1]):
        if first.out_features == 2 * second.in_features and second.out_features == first.in_features:
            return a, b
    return None


def _activation(module: nn.Module, device, dtype) -> str | None:
    """The activation kind of the one child module (act_fn, activation_fn, activation...) that is one:
    a child without parameters that computes one of ours on a probe."""
    kinds = set()
    for child in module.children():
        if next(child.parameters(), None) is None:
            try:
                kinds.add(activation_kind(child, device, dtype))
            except Exception:  # not elementwise: not an activation
                pass
    kinds.discard(None)
    return kinds.pop() if len(kinds) == 1 else None


def _keep_if_same(module: nn.Module, forward, x: torch.Tensor) -> bool:
    """Install `forward` if it reproduces the module's own output on the probe `x`."""
    with torch.no_grad():
        try:  # a module that takes more than x (an attention with two Linear children) is no MLP
            ok = same(forward(module, x), module(x))
        except Exception:
            ok = False
    if ok:
        module.forward = types.MethodType(forward, module)
    return ok


def patch_mlps(model: nn.Module, device, dtype, feeds_residual: bool = False) -> int:
    """Give every gated MLP whose activation we recognise the fused forward (checked on a probe).

    `feeds_residual`: the family's decoder layers add the MLP output straight to the residual stream,
    so a checkpoint's recompute pass may skip computing it when the MLP's weights are trained.
    """
    patched = 0
    for module in model.modules():
        if hasattr(module, "_unsloth_act"):
            continue
        if _is_gated_mlp(module):
            kind = activation_kind(module.act_fn, device, dtype)
            if kind is None:
                continue
            width = _in_features(module.gate_proj)
            if width is None:
                continue
            module._unsloth_act = kind
            x = torch.randn(2, 3, width, device=device, dtype=dtype)
            if _keep_if_same(module, _gated_mlp_forward, x):
                if feeds_residual:
                    module._unsloth_mlp_feeds_residual = True
                patched += 1
            else:
                del module._unsloth_act
            continue
        layout = _fused_layout(module)
        kind = _activation(module, device, dtype) if layout else None
        if kind is None:
            continue
        module._unsloth_act = kind
        x = torch.randn(2, 3, getattr(module, layout[0]).in_features, device=device, dtype=dtype)
        for gate_first in (True, False):
            module._unsloth_fused = (*layout, gate_first)
            if _keep_if_same(module, _fused_gated_mlp_forward, x):
                patched += 1
                break
        else:
            del module._unsloth_act, module._unsloth_fused
    return patched
