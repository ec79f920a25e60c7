"""Gated MLP activations in Triton: swiglu = silu(gate) * up, geglu = gelu(gate) * up.

Elementwise and bandwidth-bound. Forward saves only gate and up; backward recomputes the
activation and its derivative in fp32 and writes d_gate / d_up straight into the gate / up
buffers (no extra allocation: they are dead once backward runs) when those are intermediate
activations. Leaf tensors are user data and are never overwritten: their gradients get new buffers.

Inputs are (..., n) with unit stride in the last dim; any row stride works, so the two halves
of a fused gate_up projection can be passed without copying.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import cdiv, check_device

_SILU, _GELU, _GELU_TANH = 0, 1, 2
ACT_CODES = {"swiglu": _SILU, "geglu": _GELU, "geglu_tanh": _GELU_TANH}  # name -> the kernels' ACT
_BLOCK = 1024  # elements per program: 8 per thread at 4 warps, 16-byte loads for 16-bit dtypes


@triton.jit
def activation_and_derivative(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32; ACT is _SILU, _GELU or _GELU_TANH (the LoRA MLP kernels share it)."""
    if ACT == 0:  # silu
        sig = tl.sigmoid(g)
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    elif ACT == 1:  # exact gelu: g * Phi(g)
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:  # tanh-approximate gelu, via 0.5 * (1 + tanh(z)) = sigmoid(2z): no tanh intrinsic needed,
        # and 1 - tanh(z)^2 = 4 sig(2z) sig(-2z) keeps full precision where 1 - tanh(z)^2 would cancel
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        sig = tl.sigmoid(2.0 * z)
        dz = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        return g * sig, sig + 2.0 * g * sig * tl.sigmoid(-2.0 * z) * dz


@direct_launch
@triton.jit
def _glu_fwd(G, U, Y, n_cols, n_col_blocks, stride_g, stride_u, stride_y,
             ACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = activation_and_derivative(g, ACT)
    tl.store(Y + row * stride_y + cols, (act * u).to(Y.dtype.element_ty), mask=mask)


@direct_launch
@triton.jit
def _glu_bwd(DY, G, U, DG, DU, n_cols, n_col_blocks, stride_dy, stride_g, stride_u, stride_dg, stride_du,
             ACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = activation_and_derivative(g, ACT)
    tl.store(DG + row * stride_dg + cols, (dy * u * dact).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dy * act).to(DU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, n) view with unit column stride and one row stride (copies only if it must)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims not collapsible into one stride
        return t.contiguous().view(-1, t.shape[-1])


def _grid(n_rows: int, n_cols: int) -> tuple[int, int]:
    n_col_blocks = cdiv(n_cols, _BLOCK)
    return n_rows * n_col_blocks, n_col_blocks


class GatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        g2, u2 = _rows(gate), _rows(up)
        n_rows, n_cols = g2.shape
        y = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
        n_programs, n_col_blocks = _grid(n_rows, n_cols)
        _glu_fwd[(n_programs,)](g2, u2, y, n_cols, n_col_blocks, g2.stride(0), u2.stride(0), y.stride(0),
                                ACT=act, BLOCK=_BLOCK, num_warps=4)
        # Backward may overwrite a buffer that is an intermediate activation or our own copy;
        # a leaf is user data.
        ctx.reuse = (not gate.is_leaf or g2.data_ptr() != gate.data_ptr(),
                     not up.is_leaf or u2.data_ptr() != up.data_ptr())
        ctx.save_for_backward(g2, u2)
        ctx.act, ctx.shape = act, tuple(gate.shape)  # a tuple: view(torch.Size) is slower
        return y.view_as(gate)  # view_as: view(torch.Size) costs µs per call

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dy2 = _rows(dy)
        n_rows, n_cols = g2.shape
        dg = g2 if ctx.reuse[0] else torch.empty_like(g2)
        du = u2 if ctx.reuse[1] else torch.empty_like(u2)
        n_programs, n_col_blocks = _grid(n_rows, n_cols)
        _glu_bwd[(n_programs,)](dy2, g2, u2, dg, du, n_cols, n_col_blocks,
                                dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0),
                                ACT=ctx.act, BLOCK=_BLOCK, num_warps=4)
        return dg.view(ctx.shape), du.view(ctx.shape), None


def _gated(name: str, gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"{name}: gate dtype {gate.dtype} != up dtype {up.dtype}")
    check_device(gate, up)
    return GatedActivationFunction.apply(gate, up, act)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (Llama, Mistral, Qwen MLPs)."""
    return _gated("swiglu", gate, up, _SILU)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up (Gemma MLPs); approximate="tanh" is gelu_pytorch_tanh, "none" the erf form."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _gated("geglu", gate, up, _GELU if approximate == "none" else _GELU_TANH)
