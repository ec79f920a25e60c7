"""LayerNorm forward/backward in Triton: y = (x - mean) * rstd * w + b, statistics in fp32.

Matches torch.nn.functional.layer_norm (which also computes in fp32 for 16-bit inputs). Forward
saves mean and rstd (two fp32 per row); backward reduces dW and dB with per-program partial
sums, the same scheme as rms_norm: one small kernel then sums both groups of partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import cdiv, check_device, row_tile, rows_of, split_rows, sum_partials


@direct_launch
@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, MEAN, RSTD,
    n_rows, n_cols, eps, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    tl.store(MEAN + rows, mean, mask=rows < n_rows)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(X, DY, MEAN, RSTD, rows, cols, last, n_cols, stride_x, stride_dy):
    """x, dy (storage dtype), mean and rstd for a tile of rows; rows past `last` read nothing."""
    row_mask = rows < last
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy, tl.load(MEAN + rows, mask=row_mask, other=0.0), tl.load(RSTD + rows, mask=row_mask, other=0.0)


@direct_launch
@triton.jit
def _layer_norm_bwd(
    DY, X, W, MEAN, RSTD, DX, PARTIALS,
    n_rows, n_cols, rows_per_program, stride_dy, stride_x, stride_dx,
    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)  # 1-D: BLOCK_M x fewer registers than a tile
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # The next tile's loads are issued before this tile's math (see rms_norm's backward).
    rows = first + tl.arange(0, BLOCK_M)
    x, dy, mean, rstd = _load_tile(X, DY, MEAN, RSTD, rows, cols, last, n_cols, stride_x, stride_dy)
    for _ in range(first, last, BLOCK_M):
        next_rows = rows + BLOCK_M
        x_next, dy_next, mean_next, rstd_next = _load_tile(X, DY, MEAN, RSTD, next_rows, cols, last, n_cols,
                                                           stride_x, stride_dy)
        mask = (rows[:, None] < last) & col_mask[None, :]
        x_hat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dyf = dy.to(tl.float32)
        if HAS_DW:
            dw += tl.sum(dyf * x_hat, axis=0)
        if HAS_DB:
            db += tl.sum(dyf, axis=0)
        g = dyf * w[None, :]
        c1 = tl.sum(g * x_hat, axis=1) / n_cols
        c2 = tl.sum(g, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * c1[:, None] - c2[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        rows, x, dy, mean, rstd = next_rows, x_next, dy_next, mean_next, rstd_next
    # PARTIALS is (groups, programs, n_cols) fp32: dW's rows, then dB's (see _utils.sum_partials).
    if HAS_DW:
        tl.store(PARTIALS + pid * n_cols + cols, dw, mask=col_mask)
    if HAS_DB:
        row = pid
        if HAS_DW:
            row += tl.num_programs(0)
        tl.store(PARTIALS + row * n_cols + cols, db, mask=col_mask)


def layer_norm_forward(x, weight, bias, eps):
    """y (shaped like x), and what backward needs: the rows of x, mean and rstd."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    x_rows, stride_x = rows_of(x, n_cols)
    # Made like x, contiguous: no view of a 2-D buffer to return (each view costs host time).
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_m, block_n, warps = row_tile(n_cols, "forward")
    _layer_norm_fwd[(cdiv(n_rows, block_m),)](
        x_rows, weight, bias if bias is not None else weight, y, mean, rstd,
        n_rows, n_cols, eps, stride_x, n_cols,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return y, x_rows, mean, rstd


def layer_norm_backward(dy, x_rows, weight, bias, mean, rstd, need_dw=True, need_db=None):
    """(dx shaped like dy, dW or None, dB or None). By default dB is computed when there is a
    bias; a gradient not needed (frozen norms, as in LoRA) is neither accumulated nor reduced."""
    if need_db is None:
        need_db = bias is not None
    n_cols = x_rows.shape[-1]
    n_rows = mean.shape[0]
    x_rows, stride_x = rows_of(x_rows, n_cols)
    dy_rows, stride_dy = rows_of(dy, n_cols)
    dx = torch.empty_like(dy, dtype=x_rows.dtype, memory_format=torch.contiguous_format)
    block_m, block_n, warps = row_tile(n_cols, "backward")
    n_programs, rows_per_program = split_rows(n_rows, block_m, dx.device)
    # dW and dB partial rows in one (groups, programs, cols) buffer: one small kernel sums both.
    n_groups = need_dw + need_db
    partials = torch.empty((n_groups, n_programs, n_cols), dtype=torch.float32, device=dx.device) if n_groups else dx
    _layer_norm_bwd[(n_programs,)](
        dy_rows, x_rows, weight, mean, rstd, dx, partials,
        n_rows, n_cols, rows_per_program, stride_dy, stride_x, n_cols,
        HAS_DW=need_dw, HAS_DB=need_db, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(bias) if need_db else None
    if n_groups:
        sum_partials(partials, *(g for g in (dw, db) if g is not None))
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, x_rows, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        # Inputs go through save_for_backward (it catches their in-place changes); the statistics,
        # made here, are kept on ctx: every saved tensor costs host time to pack and unpack.
        ctx.save_for_backward(x_rows, weight, bias)
        ctx.mean, ctx.rstd = mean, rstd
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, bias = ctx.saved_tensors
        _, need_dw, need_db, _ = ctx.needs_input_grad
        dx, dw, db = layer_norm_backward(dy, x_rows, weight, bias, ctx.mean, ctx.rstd, need_dw, need_db)
        return dx, dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5):
    """LayerNorm over the last dimension (bias optional)."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"layer_norm: weight shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if bias is not None and bias.shape != weight.shape:
        raise ValueError(f"layer_norm: bias shape {tuple(bias.shape)} != weight shape {tuple(weight.shape)}")
    check_device(x, weight, bias)
    return LayerNormFunction.apply(x, weight.contiguous(), None if bias is None else bias.contiguous(), float(eps))


class LayerNorm(torch.nn.Module):
    """Drop-in for torch.nn.LayerNorm over the last dimension (elementwise affine)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    @property
    def variance_epsilon(self) -> float:  # the name HF's norm modules use
        return self.eps

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"
