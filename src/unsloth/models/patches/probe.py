"""Checked behaviour: a replacement is kept only if it gives the original's output on a probe input."""

from __future__ import annotations

import torch

# Per-dtype tolerance for "the same output": the kernels change the order of operations, not the math.
_TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def same(actual, expected) -> bool:
    """Outputs (tensors, or tuples of them) agree within the tolerance of their dtype."""
    if isinstance(expected, (tuple, list)):
        return len(actual) == len(expected) and all(same(a, e) for a, e in zip(actual, expected))
    if not isinstance(expected, torch.Tensor):
        return actual == expected
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    rtol, atol = _TOLERANCE.get(expected.dtype, (1e-4, 1e-5))
    actual, expected = actual.float(), expected.float()
    if expected.numel() == 0:
        return True
    # The slack is relative to the output's scale, not only to each element: after a long reduction (a
    # 14336-wide down projection) inputs rounded in another order move even the outputs near zero by
    # a few ulps of the largest ones. The norm-wise bound still catches a wrong formula, which moves
    # the whole output.
    scale = max(1.0, expected.abs().max().item())
    close = torch.allclose(actual, expected, rtol=rtol, atol=atol * scale)
    return close and (actual - expected).norm().item() <= rtol * expected.norm().item() + atol


def module_device_dtype(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where a module's computation happens and in which floating dtype (4-bit weights report their compute dtype)."""
    for p in module.parameters():
        if p.is_floating_point() and p.element_size() > 1:
            return p.device, p.dtype
    p = next(module.parameters())
    return p.device, getattr(p, "compute_dtype", None) or torch.float32
