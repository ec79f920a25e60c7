"""RMSNorm: replace each RMSNorm instance with one running our kernel on the same weight."""

from __future__ import annotations

import copy

import torch
from torch import nn

from unsloth.models.patches.probe import same

# (offset, cast): Llama-style w * x_hat cast first, or Gemma-style (1 + w) in fp32.
_CONVENTIONS = (("llama", 0.0), ("gemma", 1.0), ("llama", 1.0), ("gemma", 0.0))


class FastRMSNorm(nn.Module):
    """Our RMSNorm kernel holding the replaced module's own weight (same parameter, same state-dict key)."""

    def __init__(self, weight: nn.Parameter, eps: float, offset: float, cast: str):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.offset, self.cast = offset, cast

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from unsloth.models.kernels import compiling

        if compiling():
            return self._plain(hidden_states)
        from unsloth_kernels.rms_norm import rms_norm

        return rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=self.offset, cast=self.cast)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's math in torch ops (what torch.compile traces)."""
        x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.cast == "llama":
            return (self.weight + self.offset) * x_hat.to(x.dtype)
        return (x_hat * (self.offset + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, cast={self.cast}"


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _looks_like_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and getattr(module, "bias", None) is None
        and _eps(module) is not None
    )


def _matching_convention(module: nn.Module) -> tuple[str, float] | None:
    """The (cast, offset) under which our kernel reproduces this module, tried on a probe with a random weight."""
    probe = copy.deepcopy(module)
    weight = probe.weight
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight) * 0.5)
        x = torch.randn(3, 5, weight.shape[0], device=weight.device, dtype=weight.dtype)
        expected = probe(x)
        for cast, offset in _CONVENTIONS:
            if same(FastRMSNorm(weight, _eps(module), offset, cast)(x), expected):
                return cast, offset
    return None


def patch_rms_norms(model: nn.Module) -> int:
    """Swap every RMSNorm our kernel reproduces; returns how many were swapped."""
    swapped = 0
    conventions: dict[type, tuple[str, float] | None] = {}  # one probe per class
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FastRMSNorm) or not _looks_like_rms_norm(child):
                continue
            kind = type(child)
            if kind not in conventions:
                conventions[kind] = _matching_convention(child)
            if conventions[kind] is None:
                continue
            cast, offset = conventions[kind]
            setattr(parent, name, FastRMSNorm(child.weight, _eps(child), offset, cast))
            swapped += 1
    return swapped

