"""RMSNorm forward/backward in Triton, with an optional fused residual add.

    y = x / sqrt(mean(x^2) + eps) * (offset + w)

Two casting conventions, matching the Hugging Face modules:
- "llama" (LlamaRMSNorm, Mistral, Qwen...): the normalised row is computed in fp32, cast to the input
  dtype, then multiplied by the weight: `weight * hidden.to(input_dtype)`.
- "gemma" (GemmaRMSNorm, offset=1.0): everything in fp32, `(x_hat * (1 + w.float())).to(dtype)`.

Forward saves only the per-row rstd (one fp32 per row). Backward reads x, dy (and rstd), writes dx,
and reduces dW with per-program partial sums: a few programs per SM each walk a contiguous chunk
of rows keeping an fp32 dW accumulator in registers, then one small kernel (_utils.sum_partials)
sums the programs' rows and casts to the weight dtype. A frozen weight skips both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import cdiv, check_device, row_tile, rows_of, split_rows, sum_partials

_CASTS = ("llama", "gemma")


@direct_launch
@triton.jit
def _rms_norm_fwd(
    X, R, S, W, Y, RSTD,
    n_rows, n_cols, eps, offset,
    stride_x, stride_r, stride_s, stride_y,
    HAS_RESIDUAL: tl.constexpr, LLAMA_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # HF adds in the activation dtype (torch computes in fp32 and rounds), then normalises that
        # rounded sum: so do we.
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)  # rsqrt, like torch.rsqrt in HF
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
    x_hat = xf * rstd[:, None]
    if LLAMA_CAST:
        x_hat = x_hat.to(x.dtype).to(tl.float32)
    y = x_hat * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(X, DY, DS, RSTD, rows, cols, last, n_cols, stride_x, stride_dy, stride_ds, HAS_DS: tl.constexpr):
    """x, dy and (with HAS_DS) ds, in their storage dtype, and rstd for a tile of rows; rows past
    `last` read nothing. Without HAS_DS the ds returned is dy, unread by the caller."""
    row_mask = rows < last
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    ds = dy
    if HAS_DS:
        ds = tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0)
    return x, dy, ds, tl.load(RSTD + rows, mask=row_mask, other=0.0)


@direct_launch
@triton.jit
def _rms_norm_bwd(
    DY, DS, X, W, RSTD, DX, DW_PARTIAL,
    n_rows, n_cols, offset, rows_per_program,
    stride_dy, stride_ds, stride_x, stride_dx,
    HAS_DS: tl.constexpr, HAS_DW: tl.constexpr, LLAMA_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)  # 1-D: BLOCK_M x fewer registers than a tile
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # Software pipelining by hand: the next tile's loads are issued before this tile's math, so
    # memory stays busy while the row reductions synchronise the program's warps.
    rows = first + tl.arange(0, BLOCK_M)
    x, dy, ds, rstd = _load_tile(X, DY, DS, RSTD, rows, cols, last, n_cols, stride_x, stride_dy, stride_ds, HAS_DS)
    for _ in range(first, last, BLOCK_M):
        next_rows = rows + BLOCK_M
        x_next, dy_next, ds_next, rstd_next = _load_tile(X, DY, DS, RSTD, next_rows, cols, last, n_cols,
                                                         stride_x, stride_dy, stride_ds, HAS_DS)  # fmt: skip
        mask = (rows[:, None] < last) & col_mask[None, :]
        x_hat = x.to(tl.float32) * rstd[:, None]
        dyf = dy.to(tl.float32)
        # dW sees exactly the factor the forward multiplied by (Llama: the row rounded to dtype).
        if HAS_DW:
            if LLAMA_CAST:
                dw += tl.sum(dyf * x_hat.to(x.dtype).to(tl.float32), axis=0)
            else:
                dw += tl.sum(dyf * x_hat, axis=0)
        g = dyf * w[None, :]
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        if HAS_DS:  # gradient reaching the residual sum directly (fused add): both add up
            dx += ds.to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        rows, x, dy, ds, rstd = next_rows, x_next, dy_next, ds_next, rstd_next
    if HAS_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)


def rms_norm_forward(x, weight, eps, offset, residual, cast):
    """y (shaped like x), the rows backward reads (x, or the sum x + residual: an output too,
    shaped like x) and the per-row rstd."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    x_rows, stride_x = rows_of(x, n_cols)
    # Llama's `weight * hidden.to(dtype)` follows torch's type promotion (fp32 weight -> fp32 out).
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if cast == "llama" else x.dtype
    # Outputs made like x, contiguous: no view of a 2-D buffer to return (each view costs host time).
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if residual is None:
        r_rows, s, stride_r = x_rows, y, 0  # placeholders the kernel never touches
    else:
        r_rows, stride_r = rows_of(residual, n_cols)
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_m, block_n, warps = row_tile(n_cols, "forward")
    _rms_norm_fwd[(cdiv(n_rows, block_m),)](
        x_rows, r_rows, s, weight, y, rstd,
        n_rows, n_cols, eps, offset,
        stride_x, stride_r, n_cols, n_cols,
        HAS_RESIDUAL=residual is not None, LLAMA_CAST=cast == "llama",
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return y, (x_rows if residual is None else s), rstd


def rms_norm_backward(dy, ds, x_rows, weight, rstd, offset, cast, input_dtype, need_dw=True):
    """(dx shaped like dy, dW or None): dW only when `need_dw` (frozen norms, as in LoRA, skip its
    reduction). `x_rows` is what the forward returned for backward."""
    n_cols = x_rows.shape[-1]
    n_rows = rstd.shape[0]
    x_rows, stride_x = rows_of(x_rows, n_cols)
    dy_rows, stride_dy = rows_of(dy, n_cols)
    ds_rows, stride_ds = (dy_rows, stride_dy) if ds is None else rows_of(ds, n_cols)
    dx = torch.empty_like(dy, dtype=input_dtype, memory_format=torch.contiguous_format)
    block_m, block_n, warps = row_tile(n_cols, "backward")
    n_programs, rows_per_program = split_rows(n_rows, block_m, dx.device)
    # Per-program fp32 partial rows of dW, summed by one small kernel below.
    partials = torch.empty((1, n_programs, n_cols), dtype=torch.float32, device=dx.device) if need_dw else dx
    _rms_norm_bwd[(n_programs,)](
        dy_rows, ds_rows, x_rows, weight, rstd, dx, partials,
        n_rows, n_cols, offset, rows_per_program,
        stride_dy, stride_ds, stride_x, n_cols,
        HAS_DS=ds is not None, HAS_DW=need_dw, LLAMA_CAST=cast == "llama",
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    if not need_dw:
        return dx, None
    dw = torch.empty_like(weight)
    sum_partials(partials, dw)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, residual, cast):
        y, x_rows, rstd = rms_norm_forward(x, weight, eps, offset, residual, cast)
        # x (or the sum, an output) and the weight go through save_for_backward, which catches
        # their in-place changes; rstd, made here, is kept on ctx: every saved tensor costs host
        # time to pack and unpack.
        ctx.save_for_backward(x_rows, weight)
        ctx.rstd = rstd
        ctx.offset, ctx.cast, ctx.has_residual, ctx.dtype = offset, cast, residual is not None, x.dtype
        if residual is None:
            return y
        return y, x_rows

    @staticmethod
    def backward(ctx, dy, ds=None):
        x_rows, weight = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[1]
        dx, dw = rms_norm_backward(dy, ds, x_rows, weight, ctx.rstd, ctx.offset, ctx.cast, ctx.dtype, need_dw)
        # With the fused add, x and residual receive the same gradient (d(x + r) / dx = d/dr = 1).
        return dx, dw, None, None, (dx if ctx.has_residual else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0,
             residual: torch.Tensor | None = None, cast: str = "llama"):
    """RMSNorm over the last dimension; with `residual`, normalises x + residual.

    Returns y, or (y, x + residual) when `residual` is given (the sum the next layer's residual
    connection needs). `offset=1.0` with `cast="gemma"` is Gemma's `(1 + w)` norm.
    """
    if cast not in _CASTS:
        raise ValueError(f"rms_norm: cast must be one of {_CASTS}, got {cast!r}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"rms_norm: residual dtype {residual.dtype} != x dtype {x.dtype}")
    check_device(x, weight, residual)
    return RMSNormFunction.apply(x, weight.contiguous(), float(eps), float(offset), residual, cast)


class RMSNorm(torch.nn.Module):
    """Drop-in for HF's LlamaRMSNorm (cast="llama") or GemmaRMSNorm (offset=1.0, cast="gemma")."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0, cast: str = "llama",
                 device=None, dtype=None):
        super().__init__()
        init = torch.zeros if offset else torch.ones  # with an offset (Gemma) the scale is offset + w
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset, self.cast = offset, cast

    def forward(self, hidden_states, residual=None):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=self.offset,
                        residual=residual, cast=self.cast)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, cast={self.cast}"
