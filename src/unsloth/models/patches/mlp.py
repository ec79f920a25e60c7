"""Gated MLP: gate/up/down projections with a SiLU or GELU gate run through our fused activation kernel.

The module keeps its projections (so LoRA wrappers on them still apply); only the
`act(gate) * up` in the middle becomes one kernel. The kind of activation is read off the
module's own `act_fn` on a probe, never off a class name.
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
    return self.down_proj(gated(self._unsloth_act, self.gate_proj(x), self.up_proj(x)))


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def patch_mlps(model: nn.Module, device, dtype) -> int:
    """Give every gated MLP whose activation we recognise the fused forward (checked on a probe)."""
    patched = 0
    for module in model.modules():
        if not _is_gated_mlp(module) or hasattr(module, "_unsloth_act"):
            continue
        kind = activation_kind(module.act_fn, device, dtype)
        if kind is None:
            continue
        in_features = module.gate_proj.in_features
        x = torch.randn(2, 3, in_features, device=device, dtype=dtype)
        with torch.no_grad():
            expected = module(x)
            module._unsloth_act = kind
            try:
                ok = same(_gated_mlp_forward(module, x), expected)
            except Exception:
                ok = False
        if not ok:
            del module._unsloth_act
            continue
        module.forward = types.MethodType(_gated_mlp_forward, module)
        patched += 1
    return patched
